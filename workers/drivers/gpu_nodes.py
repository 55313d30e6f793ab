"""The /dev nodes that give a process sandbox its GPUs, and no other GPU.

CUDA opens device nodes, not UUIDs: ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` (and, when it
exists, ``/dev/nvidia-uvm-tools``, which profilers use), the GPU's ``/dev/nvidia<minor>``
and, for a MIG device, its parent's ``/dev/nvidia<minor>`` plus the two capability nodes
of its GPU instance and compute instance (``/dev/nvidia-caps/nvidia-cap<M>``). A GPU whose
node is absent from the sandbox's /dev does not exist for CUDA, so binding exactly these is
what isolates one sandbox's GPU or MIG instance from every other one on the host; the
``CUDA_VISIBLE_DEVICES`` the sandbox also gets is the tenant's to unset.

Where each number comes from:

* the minor: NVML (asked through ``workers.gpu.nvml_session.device_ids``: only the GPU
  package calls NVML), ``nvmlDeviceGetMinorNumber`` on the handle for the UUID (for a MIG
  device, on its parent from ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``); without
  NVML, ``<proc>/gpus/*/information`` ("GPU UUID", "Device Minor"), which the driver fills
  in only for initialised GPUs and which knows no MIG device;
* a MIG device's GPU and compute instance ids: NVML (``nvmlDeviceGetGpuInstanceId``,
  ``nvmlDeviceGetComputeInstanceId``);
* the capability minors: ``<proc>/capabilities/gpu<minor>/mig/gi<G>/access`` and
  ``…/gi<G>/ci<C>/access``, line ``DeviceFileMinor: N`` (what the NVIDIA container
  toolkit reads too, ``internal/nvcaps``).

A node that should exist and does not is a launch error naming the node and the command
that creates it: inside bwrap there is no setuid ``nvidia-modprobe`` for libcuda to call,
so CUDA would fail with ``CUDA_ERROR_UNKNOWN`` (999) or "no CUDA-capable device". Caps
nodes of a freshly made MIG instance and ``/dev/nvidia-uvm`` before anything loaded the
module are the usual cases.

The same devices say which ``<proc>/gpus/<bus id>`` directories a sandbox may see
(``proc_mask_args``): the driver lists every GPU of the host there, and a fresh procfs shows
them all; libnvidia-container gives a container only its own GPUs' entries, and so does the
process driver, with a read-only tmpfs over the directory and each own GPU's entry bound
back (a MIG device's is its parent's).

``GpuNodes`` takes the /proc and /dev roots and the NVML lookup as parameters, so tests run
it against fake trees.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from workers.drivers.base import DriverError
from workers.gpu.nvml_session import DeviceIds, device_ids

PROC_ROOT = Path("/proc/driver/nvidia")
# Where a sandbox, in the fresh procfs bwrap gives it, finds the driver's directory.
SANDBOX_PROC_ROOT = "/proc/driver/nvidia"
DEV_ROOT = Path("/dev")
_REQUIRED_CONTROL = ("nvidiactl", "nvidia-uvm")
_OPTIONAL_CONTROL = ("nvidia-uvm-tools",)  # profiling only: bound when present
MODPROBE = "nvidia-modprobe"


# UUID -> its ids; raises LookupError when it cannot say (NVML absent, UUID unknown).
NvmlLookup = Callable[[str], DeviceIds]


@dataclass(frozen=True)
class Node:
    host: Path  # the node on the host
    path: str  # where the sandbox sees it, always under /dev


def _fields(path: Path) -> dict[str, str]:
    """``Key: value`` lines of a /proc/driver/nvidia file."""
    fields = {}
    for line in path.read_text().splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key.strip()] = value.strip()
    return fields


class GpuNodes:
    """Resolves device UUIDs to the nodes a sandbox must get (see the module docstring)."""

    def __init__(
        self,
        proc_root: Path = PROC_ROOT,
        dev_root: Path = DEV_ROOT,
        nvml: NvmlLookup | None = device_ids,
    ) -> None:
        self.proc_root = Path(proc_root)
        self.dev_root = Path(dev_root)
        self.nvml = nvml

    def _proc_minors(self) -> dict[str, int]:
        """UUID -> minor from ``<proc>/gpus/*/information`` (initialised GPUs only)."""
        minors: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for info in sorted(self.proc_root.glob("gpus/*/information")):
                with contextlib.suppress(OSError, KeyError, ValueError):
                    fields = _fields(info)
                    minors[fields["GPU UUID"]] = int(fields["Device Minor"])
        return minors

    def ids(self, device_uuid: str) -> DeviceIds:
        why = "no NVML lookup"
        if self.nvml is not None:
            try:
                return self.nvml(device_uuid)
            except LookupError as exc:
                why = str(exc)
        if device_uuid.startswith("MIG-"):
            raise DriverError(
                f"MIG device {device_uuid}: cannot find its GPU and compute instance without NVML "
                f"({why}); refusing to bind every GPU node instead"
            )
        minor = self._proc_minors().get(device_uuid)
        if minor is None:
            raise DriverError(
                f"GPU {device_uuid}: no device minor, neither from NVML ({why}) nor in "
                f"{self.proc_root / 'gpus'} (the driver fills that in for initialised GPUs: "
                "enable persistence mode, nvidia-smi -pm 1)"
            )
        return DeviceIds(minor=minor)

    def proc_mask_args(self, uuids: Iterable[str], sandbox_root: str = SANDBOX_PROC_ROOT) -> list[str]:
        """bwrap arguments (after its ``--proc``) that leave only the GPUs of ``uuids`` in
        ``<sandbox_root>/gpus``: a read-only tmpfs over it, each of their directories bound
        back read-only from this host's ``<proc>/gpus``. A GPU's directory is told by its
        ``information`` file's ``Device Minor``. [] for no device, or a host without the
        directory (no driver loaded), where a fresh procfs has nothing to hide."""
        gpus = self.proc_root / "gpus"
        if not gpus.is_dir():
            return []
        minors = {self.ids(u).minor for u in uuids}
        if not minors:
            return []
        target = f"{sandbox_root.rstrip('/')}/gpus"
        args = ["--perms", "0555", "--tmpfs", target]
        for entry in sorted(gpus.iterdir()):
            with contextlib.suppress(OSError, KeyError, ValueError):
                if int(_fields(entry / "information")["Device Minor"]) in minors:
                    args += ["--ro-bind", str(entry), f"{target}/{entry.name}"]
        return [*args, "--remount-ro", target]

    def _cap_minor(self, access: Path, device_uuid: str) -> int:
        try:
            return int(_fields(access)["DeviceFileMinor"])
        except (OSError, KeyError, ValueError) as exc:
            raise DriverError(
                f"MIG device {device_uuid}: no capability minor in {access} ({exc}); has the "
                "instance been destroyed?"
            ) from exc

    def _wanted(self, uuids: Iterable[str]) -> list[tuple[str, list[str]]]:
        """(node name under /dev, the nvidia-modprobe argv that creates it) for every node
        the devices need, each once, optional ones only when present."""
        all_ids = [(u, self.ids(u)) for u in uuids]
        if not all_ids:
            return []
        first_minor = all_ids[0][1].minor
        wanted: dict[str, list[str]] = {}
        for name in _REQUIRED_CONTROL:
            wanted[name] = [MODPROBE, "-u", "-c", str(first_minor)]
        for name in _OPTIONAL_CONTROL:
            if (self.dev_root / name).exists():
                wanted[name] = [MODPROBE, "-u"]
        for device_uuid, ids in all_ids:
            wanted.setdefault(f"nvidia{ids.minor}", [MODPROBE, "-c", str(ids.minor)])
            if ids.gi is None or ids.ci is None:
                continue
            gi_dir = self.proc_root / "capabilities" / f"gpu{ids.minor}" / "mig" / f"gi{ids.gi}"
            for access in (gi_dir / "access", gi_dir / f"ci{ids.ci}" / "access"):
                cap = self._cap_minor(access, device_uuid)
                wanted.setdefault(f"nvidia-caps/nvidia-cap{cap}", [MODPROBE, "-f", str(access)])
        return list(wanted.items())

    def nodes(self, uuids: Iterable[str]) -> list[Node]:
        """Every node the devices need, each once; none for no device (a CPU-only sandbox).
        Raises DriverError naming the node and its remedy when one is missing."""
        found = []
        for name, remedy in self._wanted(uuids):
            host = self.dev_root / name
            if not host.exists():
                raise DriverError(
                    f"device node /dev/{name} is missing on this host ({host}); CUDA cannot create "
                    f"it inside the sandbox: run {' '.join(remedy)} (as root) and launch again"
                )
            found.append(Node(host=host, path=f"/dev/{name}"))
        return found

    def create_missing(
        self, uuids: Iterable[str], run: Callable[[list[str]], object] | None = None
    ) -> list[list[str]]:
        """Run the ``nvidia-modprobe`` that creates each missing node of ``uuids`` (setuid
        root where the driver installed it), as libcuda would on the host; the commands run.
        For the agent at start and after it creates MIG instances, whose caps nodes do not
        exist until someone asks. A node still missing afterwards fails the launch as usual."""
        ran: list[list[str]] = []
        for name, remedy in self._wanted(uuids):
            if not (self.dev_root / name).exists() and remedy not in ran:
                (run or _run_modprobe)(remedy)
                ran.append(remedy)
        return ran


def _run_modprobe(argv: list[str]) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=30, check=False)  # noqa: S603 - fixed tool
