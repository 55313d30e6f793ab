"""The GPU device nodes a process sandbox gets, resolved against fake /proc and /dev trees.

A host with two H100s (minors 0 and 3) and, on the second, MIG instances; NVML is either a
lookup function (the seam) or pynvml itself with its functions replaced, so the real
lookup's calls are checked too. No GPU is needed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from workers.drivers.base import DriverError
from workers.drivers.gpu_nodes import GpuNodes, Node
from workers.drivers.process import _gpu_device_nodes
from workers.gpu.nvml_session import DeviceIds, device_ids

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MIG_1 = "MIG-11111111-0000-0000-0000-000000000000"  # gi 1, ci 0 on GPU_B
MIG_2 = "MIG-22222222-0000-0000-0000-000000000000"  # gi 2, ci 0 on GPU_B
IDS = {
    GPU_A: DeviceIds(minor=0),
    GPU_B: DeviceIds(minor=3),
    MIG_1: DeviceIds(minor=3, gi=1, ci=0),
    MIG_2: DeviceIds(minor=3, gi=2, ci=0),
}
# (gi, ci) -> the capability minors the driver gives their access files.
CAPS = {(1, None): 30, (1, 0): 31, (2, None): 39, (2, 0): 40}


def lookup(device_uuid: str) -> DeviceIds:
    if device_uuid not in IDS:
        raise LookupError(f"NVML: {device_uuid} not found")
    return IDS[device_uuid]


def no_nvml(device_uuid: str) -> DeviceIds:
    raise LookupError("NVML did not initialise: Driver Not Loaded")


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    """(proc root, dev root) of the fake host, every node present."""
    proc, dev = tmp_path / "proc" / "driver" / "nvidia", tmp_path / "dev"
    for bus, uuid, minor in (("0000:1b:00.0", GPU_A, 0), ("0000:3b:00.0", GPU_B, 3)):
        info = proc / "gpus" / bus / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
    for (gi, ci), cap in CAPS.items():
        gi_dir = proc / "capabilities" / "gpu3" / "mig" / f"gi{gi}"
        access = gi_dir / "access" if ci is None else gi_dir / f"ci{ci}" / "access"
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(f"DeviceFileMinor: {cap}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia3", "nvidia-modeset"):
        (dev / name).touch()
    for cap in CAPS.values():
        (dev / "nvidia-caps" / f"nvidia-cap{cap}").touch()
    (dev / "nvidia-caps" / "nvidia-cap1").touch()  # MIG config: never a sandbox's
    return proc, dev


def paths(nodes: list[Node]) -> list[str]:
    return [node.path for node in nodes]


def test_a_gpu_gets_its_own_node_and_the_control_nodes_only(host: tuple[Path, Path]) -> None:
    proc, dev = host
    nodes = GpuNodes(proc, dev, lookup).nodes((GPU_B,))
    assert paths(nodes) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia3"]
    assert [node.host for node in nodes] == [dev / p.removeprefix("/dev/") for p in paths(nodes)]
    assert GpuNodes(proc, dev, lookup).nodes(()) == []  # CPU only: no GPU node at all


def test_without_nvml_the_minor_comes_from_proc(host: tuple[Path, Path]) -> None:
    proc, dev = host
    assert paths(GpuNodes(proc, dev, no_nvml).nodes((GPU_A,)))[-1] == "/dev/nvidia0"
    assert paths(GpuNodes(proc, dev, None).nodes((GPU_B, GPU_A)))[-2:] == ["/dev/nvidia3", "/dev/nvidia0"]
    # Not initialised (no persistence): no UUID in /proc either, so no guess at a node.
    with pytest.raises(DriverError, match=r"GPU-cccc: no device minor.*nvidia-smi -pm 1"):
        GpuNodes(proc, dev, no_nvml).nodes(("GPU-cccc",))


def test_a_mig_device_gets_its_parent_and_exactly_its_two_caps(host: tuple[Path, Path]) -> None:
    """The old driver bound every /dev/nvidiaN and all of /dev/nvidia-caps for MIG, leaving
    isolation to CUDA_VISIBLE_DEVICES, which the tenant can unset."""
    proc, dev = host
    nodes = paths(GpuNodes(proc, dev, lookup).nodes((MIG_2,)))
    assert nodes == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia3",
        "/dev/nvidia-caps/nvidia-cap39", "/dev/nvidia-caps/nvidia-cap40",
    ]  # fmt: skip
    assert "/dev/nvidia-caps" not in nodes and "/dev/nvidia0" not in nodes
    # Two instances of one GPU: the parent once, each instance's caps.
    both = paths(GpuNodes(proc, dev, lookup).nodes((MIG_1, MIG_2)))
    assert both.count("/dev/nvidia3") == 1
    assert [n for n in both if "cap" in n] == [f"/dev/nvidia-caps/nvidia-cap{c}" for c in (30, 31, 39, 40)]


def test_a_mig_device_without_nvml_is_refused_not_given_every_node(host: tuple[Path, Path]) -> None:
    proc, dev = host
    with pytest.raises(DriverError, match=r"MIG device MIG-1111.*without NVML.*refusing to bind every"):
        GpuNodes(proc, dev, no_nvml).nodes((MIG_1,))


@pytest.mark.parametrize(
    ("missing", "remedy"),
    [
        ("nvidia-uvm", "nvidia-modprobe -u -c 3"),
        ("nvidiactl", "nvidia-modprobe -u -c 3"),
        ("nvidia3", "nvidia-modprobe -c 3"),
        ("nvidia-caps/nvidia-cap40", "nvidia-modprobe -f {proc}/capabilities/gpu3/mig/gi2/ci0/access"),
    ],
)
def test_a_missing_node_is_an_error_naming_the_node_and_the_remedy(
    host: tuple[Path, Path], missing: str, remedy: str
) -> None:
    proc, dev = host
    (dev / missing).unlink()
    with pytest.raises(DriverError) as raised:
        GpuNodes(proc, dev, lookup).nodes((MIG_2,))
    assert f"/dev/{missing} is missing" in str(raised.value)
    assert remedy.format(proc=proc) in str(raised.value)


def test_uvm_tools_is_bound_only_when_present(host: tuple[Path, Path]) -> None:
    proc, dev = host
    (dev / "nvidia-uvm-tools").unlink()
    assert "/dev/nvidia-uvm-tools" not in paths(GpuNodes(proc, dev, lookup).nodes((GPU_A,)))


def test_a_destroyed_instance_is_named(host: tuple[Path, Path]) -> None:
    proc, dev = host
    gone = "MIG-99999999-0000-0000-0000-000000000000"
    gone_ids = {**IDS, gone: DeviceIds(minor=3, gi=9, ci=0)}
    with pytest.raises(DriverError, match=r"no capability minor in .*gi9/access.*destroyed"):
        GpuNodes(proc, dev, gone_ids.__getitem__).nodes((gone,))


def test_the_compat_helper_reads_proc_gpus(host: tuple[Path, Path]) -> None:
    """gpu-checks/procdriver_check.py calls _gpu_device_nodes(uuids, <proc>/gpus): the minor
    is found there (no NVML here), then the host's real /dev lacks the nodes."""
    proc, _dev = host
    with pytest.raises(DriverError, match="/dev/nvidiactl is missing"):
        _gpu_device_nodes((GPU_A,), proc / "gpus")


class FakeNvml:
    """The pynvml functions device_ids calls, for one GPU and one MIG device on it."""

    def __init__(self) -> None:
        self.gpu, self.mig = SimpleNamespace(uuid=GPU_B), SimpleNamespace(uuid=MIG_2)
        self.inits = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByUUID", "nvmlDeviceIsMigDeviceHandle",
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetMinorNumber",
            "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId",
        ):  # fmt: skip
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> SimpleNamespace:
        for dev in (self.gpu, self.mig):
            if dev.uuid == uuid:
                return dev
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceIsMigDeviceHandle(self, dev: SimpleNamespace) -> bool:
        return dev is self.mig

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, dev: SimpleNamespace) -> SimpleNamespace:
        assert dev is self.mig
        return self.gpu

    def nvmlDeviceGetMinorNumber(self, dev: SimpleNamespace) -> int:
        if dev is self.mig:  # NVML refuses a MIG handle here: the parent must be asked
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 3

    def nvmlDeviceGetGpuInstanceId(self, dev: SimpleNamespace) -> int:
        return 2

    def nvmlDeviceGetComputeInstanceId(self, dev: SimpleNamespace) -> int:
        return 0


def test_device_ids_asks_the_parent_for_a_mig_devices_minor(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    fake.install(monkeypatch)
    assert device_ids(GPU_B) == DeviceIds(minor=3)
    assert device_ids(MIG_2) == DeviceIds(minor=3, gi=2, ci=0)
    with pytest.raises(LookupError, match="NVML"):
        device_ids("GPU-unknown")
    assert fake.inits == 0  # every init shut down again: the agent's NVML session is untouched


def test_device_ids_without_a_driver_is_a_lookup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(LookupError, match="did not initialise"):
        device_ids(GPU_A)


def test_create_missing_runs_the_modprobe_for_each_missing_node_once(host: tuple[Path, Path]) -> None:
    """What the agent can run at start and after a MIG change: libcuda cannot inside bwrap."""
    proc, dev = host
    for missing in ("nvidia-uvm", "nvidiactl", "nvidia-caps/nvidia-cap31"):
        (dev / missing).unlink()
    nodes = GpuNodes(proc, dev, lookup)
    ran: list[list[str]] = []

    def modprobe(argv: list[str]) -> None:
        ran.append(argv)
        if argv[1] == "-u":
            (dev / "nvidia-uvm").touch()
            (dev / "nvidiactl").touch()
        else:
            (dev / "nvidia-caps" / "nvidia-cap31").touch()

    access = proc / "capabilities" / "gpu3" / "mig" / "gi1" / "ci0" / "access"
    expected = [["nvidia-modprobe", "-u", "-c", "3"], ["nvidia-modprobe", "-f", str(access)]]
    assert nodes.create_missing((MIG_1,), run=modprobe) == expected == ran
    assert len(nodes.nodes((MIG_1,))) == 6  # all there now
    assert nodes.create_missing((MIG_1,), run=modprobe) == []  # nothing missing: nothing run
