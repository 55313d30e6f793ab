"""The launch message: what a sandbox is to be, as the portal sends it and a host runs it.

Tasks carry a ``SandboxSpec`` as plain JSON; the host's driver turns it into a container, a
VM or a confined process. Launch is idempotent, keyed by ``allocation_key``: a repeated
message finds the sandbox it already made. A ``SandboxHandle`` is what a driver made, as the
host reports it and the portal keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NotRequired, TypedDict

from wire.storage import StorageMount

LABEL_PREFIX = "io.gpushare"
# Fields a spec once had, still in the launch messages of an older portal and in the specs a
# process driver saved before an upgrade: read and dropped. (The metering facts: the agent
# no longer computes a running cost, the portal's billing does.)
RETIRED_SPEC_FIELDS = frozenset({"milli_gpu", "price_per_gpu_hour_micros"})
# The resume contract's checkpoint folder (portal/sandboxes/resume.py), as the sandbox sees it.
CHECKPOINT_DIR_VARIABLE = "GPUSHARE_CHECKPOINT_DIR"
# Fields renamed since, still in what an older portal or agent wrote: handles kept in the
# portal's database, specs and handles a process driver saved on disk, messages in flight
# during an upgrade.
RENAMED_FIELDS = {"allocation_id": "allocation_key"}
# The isolation level each driver gives a sandbox: a host runs one driver, so it serves
# only requests for that level (a VM request must never get a container). The state-only
# driver of simulated hosts stands in for containers, the level most requests ask for.
DRIVER_ISOLATION = {
    "docker": "container", "process": "process", "libvirt": "vm", "simulated": "container",
    # A Slurm job is a process tree on its node, confined by the cluster's task/cgroup plugin.
    "slurm": "process",
}  # fmt: skip


def renamed(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with every field under its current name."""
    return {RENAMED_FIELDS.get(k, k): v for k, v in data.items()}


@dataclass(frozen=True)
class MpsShare:
    pipe_dir: str  # CUDA_MPS_PIPE_DIRECTORY of the GPU's control daemon
    thread_pct: int  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    memory_mib: int  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for each visible device


# What happens to a sandbox that holds more GPU memory than its share (MemoryShare).
OVER_SHARE_WARN = "warn"  # its owner is warned; it keeps running
OVER_SHARE_STOP = "stop"  # its owner is warned at once, and it is stopped after the grace


@dataclass(frozen=True)
class MemoryShare:
    """What a sandbox on a shared GPU (an MPS share or a time-slice replica) may hold of each
    of its devices' memory, summed over all its processes: MPS limits bind one process each
    and time-slicing limits nothing, so the agent watches the sandbox's total (pid -> cgroup
    -> sandbox) and acts as the tier says."""

    kind: str  # "mps" | "timeslice"
    memory_mib: int  # per device: the MPS share's memory, or the GPU's memory / replicas
    replicas: int = 0  # time-slice: how many replicas the GPU is cut into (0 for MPS)
    over_share: str = OVER_SHARE_WARN  # OVER_SHARE_WARN | OVER_SHARE_STOP
    grace_s: int = 0  # OVER_SHARE_STOP: how long it may stay over before it is stopped


@dataclass(frozen=True)
class SandboxSpec:
    allocation_key: str  # idempotency key, unique per placement
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
    # On a shared GPU (MPS, time-slice): the memory it may hold, watched per sandbox.
    memory_share: MemoryShare | None = None

    @property
    def checkpoint_dir(self) -> str:
        """Its checkpoint folder as the sandbox sees it, in one of its read-write mounts: the
        agent makes it before the start (the resume contract, portal/sandboxes/resume.py); ""
        for none. Read from the variable the sandbox is told, not a field of its own, so that
        an agent not yet upgraded still reads the launch message (and makes no folder)."""
        return self.env.get(CHECKPOINT_DIR_VARIABLE, "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxSpec:
        values = {k: v for k, v in renamed(data).items() if k not in RETIRED_SPEC_FIELDS}
        values["command"] = tuple(values.get("command") or ())
        values["device_uuids"] = tuple(values.get("device_uuids") or ())
        mps = values.get("mps")
        values["mps"] = MpsShare(**mps) if mps else None
        share = values.get("memory_share")
        values["memory_share"] = MemoryShare(**share) if share else None
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
            f"{LABEL_PREFIX}.allocation": self.allocation_key,
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


class HandleJson(TypedDict):
    """A ``SandboxHandle`` as JSON: in the agents' reports, kept by the portal, sent back to stop."""

    driver: str
    allocation_key: str
    sandbox_id: int
    ref: str
    devices: NotRequired[list[str]]  # SandboxHandle.devices, when there are any


@dataclass(frozen=True)
class SandboxHandle:
    driver: str  # "docker" | "process" | "libvirt"
    allocation_key: str
    sandbox_id: int
    ref: str  # container id, pid, domain uuid, Slurm job id
    # The GPUs the engine granted, where it chose them itself (Slurm binds a job's GRES): the
    # portal's allocations follow them (portal.sandboxes.granted). () for every other driver.
    devices: tuple[str, ...] = ()

    def to_json(self) -> HandleJson:
        found = HandleJson(
            driver=self.driver, allocation_key=self.allocation_key, sandbox_id=self.sandbox_id, ref=self.ref
        )
        if self.devices:
            found["devices"] = list(self.devices)
        return found

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxHandle:
        values = renamed(data)
        values["devices"] = tuple(values.get("devices") or ())
        return cls(**values)
