"""The sandbox driver seam: launch, stop and find sandboxes at one isolation level.

Tasks carry a ``SandboxSpec`` as plain JSON; the driver turns it into a container, a VM or
a confined process. Launch is idempotent, keyed by ``allocation_id``: a repeated message
finds the sandbox it already made. Everything a driver makes carries labels (or a name)
from which ``list_owned`` rebuilds the agent's picture after a restart.
"""

from __future__ import annotations

import os
import posixpath
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workers.drivers import tenant_paths
from workers.drivers.output import OutputChunk

LABEL_PREFIX = "io.gpushare"
# Fields a spec once had, still in the launch messages of an older portal and in the specs a
# process driver saved before an upgrade: read and dropped. (The metering facts: the agent
# no longer computes a running cost, the portal's billing does.)
RETIRED_SPEC_FIELDS = frozenset({"milli_gpu", "price_per_gpu_hour_micros"})


@dataclass(frozen=True)
class MpsShare:
    pipe_dir: str  # CUDA_MPS_PIPE_DIRECTORY of the GPU's control daemon
    thread_pct: int  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    memory_mib: int  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for each visible device


@dataclass(frozen=True)
class StorageMount:
    """Persistent storage to bind (workers/drivers/storage.py resolves it on the host)."""

    name: str  # the storage's name, for messages
    source: str  # relative to the host's STORAGE_ROOT: never a host path of its own
    target: str  # where the sandbox sees it
    read_only: bool
    gid: int  # the volume's group (uids.storage_gid); 0 for a read-only dataset
    volume: int = 0  # the portal's volume id, to report its usage against; 0 for a dataset


@dataclass(frozen=True)
class SandboxSpec:
    allocation_id: str  # idempotency key, unique per placement
    sandbox_id: int
    host: str
    project: str
    owner: str
    image: str  # container image reference (docker), ignored by process
    command: tuple[str, ...]
    device_uuids: tuple[str, ...]  # GPU-... or MIG-... UUIDs the sandbox may see; () for CPU only
    # False on simulated hosts and for CPU-only sandboxes: no NVIDIA runtime device request.
    real_gpu: bool
    cpu_limit: float = 1.0
    memory_limit_mib: int = 1024
    # A pids cgroup (docker) or RLIMIT_NPROC (process, without cgroups) counts threads, not
    # just processes: PyTorch's OpenMP pool (a thread per core) in each DataLoader worker
    # reaches hundreds, so the tiers' default is in the thousands (portal Tier.pids_limit).
    pids_limit: int = 4096
    # Size of the sandbox's /dev/shm (shared memory: PyTorch DataLoader workers, NCCL);
    # 0: the driver's own default (Docker's 64 MiB; the process driver's tmpfs size).
    shm_size_mib: int = 0
    network: bool = False
    mps: MpsShare | None = None
    # The GPU is pinned to MPS by its admin: its daemon may stay up once the last share on it
    # stops. Following demand, it must stop then (the GPU may next be dedicated or sliced).
    mps_pinned: bool = False
    env: dict[str, str] = field(default_factory=dict)
    isolation: str = ""  # container, process or vm: the agent refuses one its driver cannot give
    tier: str = ""  # the tier's slug: its alert thresholds apply to this sandbox
    batch: bool = False  # a batch run: the agent ships its output to its owner
    mounts: tuple[StorageMount, ...] = ()  # the tier's storage: a home, project folders, datasets
    app: bool = False  # the image serves a web app on its app socket (workers/drivers/app_socket.py)
    pull: bool = False  # its image is from a registry an admin approved: pulled when missing
    owner_id: int = 0  # the owner's portal user id: their sandboxes run as their uid (uids.owner_uid)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxSpec:
        values = {k: v for k, v in data.items() if k not in RETIRED_SPEC_FIELDS}
        values["command"] = tuple(values.get("command") or ())
        values["device_uuids"] = tuple(values.get("device_uuids") or ())
        mps = values.get("mps")
        values["mps"] = MpsShare(**mps) if mps else None
        values["env"] = dict(values.get("env") or {})
        values["mounts"] = tuple(StorageMount(**m) for m in values.get("mounts") or ())
        return cls(**values)

    def groups(self) -> list[int]:
        """The supplementary groups its storage needs (workers/drivers/storage.py)."""
        return sorted({m.gid for m in self.mounts if m.gid and not m.read_only})

    def mounts_at(self, target: str) -> bool:
        return any(m.target == target for m in self.mounts)

    def labels(self) -> dict[str, str]:
        return {
            f"{LABEL_PREFIX}.allocation": self.allocation_id,
            f"{LABEL_PREFIX}.sandbox": str(self.sandbox_id),
            f"{LABEL_PREFIX}.host": self.host,
            f"{LABEL_PREFIX}.project": self.project,
            f"{LABEL_PREFIX}.owner": self.owner,
            f"{LABEL_PREFIX}.devices": ",".join(self.device_uuids),
        }

    def gpu_env(self) -> dict[str, str]:
        """Variables that bind the sandbox to its devices (and MPS share); a CPU-only one
        sees none ("void": the NVIDIA runtime mounts nothing, CUDA finds no device)."""
        env = {"NVIDIA_VISIBLE_DEVICES": ",".join(self.device_uuids) or "void"}
        if self.real_gpu or not self.device_uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.device_uuids)
        if self.mps is not None:
            # The share's own limits. MPS applies them below the server's, and the server holds
            # every client on the GPU to the largest share there (workers/gpu/mps_daemons.py),
            # so past that the tenant cannot go; below it these bind only while left set.
            env["CUDA_MPS_PIPE_DIRECTORY"] = self.mps.pipe_dir
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.mps.thread_pct)
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                f"{i}={self.mps.memory_mib}M" for i in range(max(1, len(self.device_uuids)))
            )
        return env


# Host paths a sandbox must never get read-write, nor any directory holding one: the host's
# root and system trees, users' homes and the container engines' sockets.
PROTECTED_HOST_PATHS = (
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/proc", "/root", "/sbin", "/sys",
    "/usr", "/var/lib/docker", "/var/lib/libvirt", "/var/run/docker.sock", "/run/docker.sock",
    "/run/containerd", "/var/run/libvirt", "/run/libvirt",
)  # fmt: skip


def checked_pipe_dir(path: str) -> str:
    """The MPS pipe directory the drivers bind read-write, after making sure it is one: an
    absolute, normalised path that is neither a protected path, inside a system tree, nor an
    ancestor of one. The agent makes it (<mps_root>/<device key>/pipe); this is defence in depth
    against a forged or corrupted launch message."""
    if not path.startswith("/") or posixpath.normpath(path) != path or "\0" in path:
        raise DriverError(f"MPS pipe directory {path!r} is not an absolute, normalised path")
    for protected in PROTECTED_HOST_PATHS:
        inside_system = protected not in ("/", "/home") and path.startswith(protected + "/")
        if path == protected or protected.startswith(path.rstrip("/") + "/") or inside_system:
            raise DriverError(f"MPS pipe directory {path!r} would expose {protected} to the sandbox")
    return path


MPS_CONTROL_SOCKET = "control"  # the control daemon's socket in its pipe directory
MPS_SOCKET_WAIT_S = 5.0  # how long a launch waits for a just-started daemon's socket


def _grants(info: os.stat_result, uid: int, bits: int) -> bool:
    """Whether ``uid`` (whose only group is its own gid, as the drivers run it) has the
    permission ``bits`` (4 read, 2 write, 1 search) on a file with this ``stat``."""
    if uid == 0:
        return True
    if info.st_uid == uid:
        shift = 6
    elif info.st_gid == uid:
        shift = 3
    else:
        shift = 0
    return (info.st_mode >> shift) & bits == bits


def require_mps_pipe(path: str, uid: int, *, real_gpu: bool, socket_wait_s: float | None = None) -> None:
    """Refuse an MPS launch whose client could not reach the GPU's MPS daemon.

    A CUDA client that cannot connect to ``<pipe_dir>/control`` does not fail: it runs as if
    MPS did not exist (man nvidia-cuda-mps-control), with the whole GPU and no thread or
    memory limit. So the pipe directory must exist and be searchable by the sandbox's host
    ``uid``, and on a real GPU the daemon's control socket must be there and writable by it
    (connect() needs both); it is waited for (``MPS_SOCKET_WAIT_S``), since the agent
    counts a daemon as up once its pid file names it. A simulated host's daemon makes no socket."""
    where = f"MPS pipe directory {path}"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise DriverError(
            f"{where} is missing ({exc.strerror}): the GPU's MPS daemon is not running; refusing "
            "to start a share that would run without MPS"
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise DriverError(f"{where} is not a directory")
    if not _grants(info, uid, 1):
        raise DriverError(
            f"{where} (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}) cannot be entered by "
            f"the sandbox's uid {uid}: its CUDA would silently run without MPS"
        )
    if not real_gpu:
        return
    control = os.path.join(path, MPS_CONTROL_SOCKET)
    deadline = time.monotonic() + (MPS_SOCKET_WAIT_S if socket_wait_s is None else socket_wait_s)
    # Waited for until it is connectable, not only there: a daemon binds its socket, then
    # widens its mode, and a launch looking in between would be refused.
    while not _connectable(path, uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        sock = _control_socket(path)
    except FileNotFoundError as exc:
        raise DriverError(
            f"{control} is missing ({exc.strerror}): the GPU's MPS daemon is not running; refusing "
            "to start a share that would run without MPS"
        ) from exc
    except OSError as exc:  # a tenant of the GPU planted a link or its own socket there
        raise DriverError(
            f"{control} is not the MPS daemon's socket ({exc.strerror or exc}): its CUDA would "
            "silently run without MPS"
        ) from exc
    if not _connectable(path, uid, sock):
        raise DriverError(
            f"{control} is not a socket the sandbox's uid {uid} can connect to: its CUDA would "
            "silently run without MPS"
        )


def _control_socket(pipe_dir: str) -> os.stat_result:
    """The daemon's control socket in ``pipe_dir``, where its clients (tenants) write too:
    looked at without following a link, and only as the daemon makes it, a socket of the
    agent's own uid (root's daemon, or a non-root agent's)."""
    folder = tenant_paths.open_folder(pipe_dir)
    try:
        control = tenant_paths.open_beneath(folder, MPS_CONTROL_SOCKET, os.O_PATH | os.O_NOFOLLOW)
    finally:
        os.close(folder)
    try:
        return tenant_paths.require(control, MPS_CONTROL_SOCKET, stat.S_IFSOCK, owner=os.geteuid())
    finally:
        os.close(control)


def _connectable(pipe_dir: str, uid: int, info: os.stat_result | None = None) -> bool:
    """Whether the daemon's socket in ``pipe_dir`` is one ``uid`` may connect() to (write
    permission on it)."""
    if info is None:
        try:
            info = _control_socket(pipe_dir)
        except OSError:
            return False
    return _grants(info, uid, 2)


@dataclass(frozen=True)
class SandboxHandle:
    driver: str  # "docker" | "process" | "libvirt"
    allocation_id: str
    sandbox_id: int
    ref: str  # container id, pid, domain uuid

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxHandle:
        return cls(**data)


@dataclass(frozen=True)
class SandboxStatus:
    state: str  # "running" | "exited" | "missing" | "created" (made, never started)
    exit_code: int | None = None
    started_at_ms: int | None = None
    reason: str | None = None  # why it exited when the driver knows, e.g. "out of memory"


class DriverError(RuntimeError):
    """The driver could not do what was asked (engine down, bad image...)."""


class SandboxDriver(Protocol):
    name: str

    @property
    def storage_dir(self) -> Path | None:
        """Where this host's persistent storage lives (workers/drivers/storage.py); None for a
        driver that mounts none (the state-only one of simulated hosts)."""
        ...

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """What a launch needs first and may take minutes (Docker: pulling an approved
        image), before the launch itself; ``report`` is given a line of progress now and
        then. Nothing, for drivers that need nothing."""
        ...

    def launch(self, spec: SandboxSpec) -> SandboxHandle: ...

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None: ...

    def warn(self, handle: SandboxHandle) -> str:
        """Tell a running sandbox it will be stopped soon, as a stop's first step does (SIGTERM
        to its command; a VM's ACPI power button) but without the stop. Returns what was done,
        for the owner's event log. A preemption's warning (portal/sandboxes/preemption.py)."""
        ...

    def status(self, handle: SandboxHandle) -> SandboxStatus: ...

    def list_owned(self) -> list[SandboxHandle]: ...

    def exec_terminal(self, handle: SandboxHandle) -> Terminal: ...

    def open_app(self, handle: SandboxHandle) -> Terminal:
        """A connection to the sandbox's web app, for the portal's proxy (a byte stream with
        the terminal's interface). DriverError when it has none or it is not listening."""
        ...

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        """At most ``limit`` bytes of the sandbox's stdout and stderr from ``offset`` (into
        all it wrote) on. The host keeps the last ``SANDBOX_OUTPUT_MAX_BYTES`` of it: a chunk
        starting beyond ``offset`` says the bytes in between were dropped."""
        ...


class Terminal(Protocol):
    """An interactive pty into a sandbox, for the portal's web terminal."""

    def write(self, data: bytes) -> None: ...

    def read(self, timeout_s: float = 0.1) -> bytes: ...

    def resize(self, rows: int, cols: int) -> None: ...

    def close(self) -> None: ...
