"""A snapshot of the fleet and of the queue: plain dataclasses the control worker fills in."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from functools import cached_property

from scheduler.topology import NO_TOPOLOGY, Topology

DEDICATED, MIG, MPS, TIMESLICE = "dedicated", "mig", "mps", "timeslice"
MODES = (DEDICATED, MIG, MPS, TIMESLICE)
# A GPU whose sharing mode follows demand: idle, it takes a dedicated, MPS or time-slice
# placement, and it is back to idle when the last one leaves. Not a request mode.
AUTO = "auto"
# What an idle AUTO GPU can turn into: MIG needs MIG mode, which needs a GPU reset.
FOLLOWS_DEMAND = (DEDICATED, MPS, TIMESLICE)
# A request for host CPU and memory only: no GPU. Not a GPU mode.
CPU_ONLY = "cpu"
MILLI = 1000  # one whole GPU, in thousandths


@dataclass
class MigSlot:
    uuid: str
    profile: str
    start: int
    memory_slices: int
    busy: bool = False


@dataclass
class GpuState:
    uuid: str
    host: str
    index: int
    model: str
    memory_mib: int
    # How this GPU is shared: one of MODES when an admin pinned it (or it is in MIG mode),
    # AUTO when it follows demand (see ``serves``).
    mode: str
    available: bool = True  # False when drained or its host is lost
    exclusive_busy: bool = False
    mig: list[MigSlot] = field(default_factory=list)
    mps_used_mib: int = 0
    mps_used_threads: int = 0
    replicas: int = 0  # time-slice replicas it offers when shared by time-slicing
    replicas_used: set[int] = field(default_factory=set)
    # The size (memory MiB, thread %) of its first MPS share; None while it holds none.
    mps_share: tuple[int, int] | None = None
    # It takes only MPS shares of that size, as NVIDIA's device plugin gives every MPS replica
    # an equal fraction: the MPS server's limits bind each client process and the daemon's
    # defaults (the largest share's) are the ceiling, so beside a larger share a small share's
    # process could take the larger one's memory. Off, shares of any size pack together (the
    # fractional packing the trace replays measure) and the agent's per-sandbox memory watch
    # warns and stops a sandbox over its share (portal setting MPS_ONE_SIZE_PER_GPU).
    mps_one_size: bool = False
    # The modes its host can give at all: every one, but for a GPU an engine in front of its
    # host binds (a Slurm node offers time-slicing only with shard GRES, MPS only with mps).
    offers: tuple[str, ...] = MODES

    @property
    def idle(self) -> bool:
        """Nothing at all placed on it."""
        # The search through MIG slices last, and only where there are any: placement asks
        # this of every GPU of every host it looks at.
        return not (
            self.exclusive_busy
            or self.mps_used_threads
            or self.mps_used_mib
            or self.replicas_used
            or (self.mig and any(s.busy for s in self.mig))
        )

    def serves(self, mode: str) -> bool:
        """Whether a ``mode`` request may be placed on it, capacity aside: its pinned mode,
        or, following demand, any mode an idle GPU can turn into and the one it is in."""
        if mode not in self.offers:
            return False
        if self.mode != AUTO:
            return self.mode == mode
        if mode not in FOLLOWS_DEMAND:
            return False
        if self.exclusive_busy:
            return mode == DEDICATED
        if self.mps_used_threads or self.mps_used_mib:
            return mode == MPS
        return not self.replicas_used or mode == TIMESLICE

    def could_serve(self, mode: str) -> bool:
        """Whether it could take a ``mode`` request once emptied (what preemption may free)."""
        return mode in self.offers and (self.mode == mode or (self.mode == AUTO and mode in FOLLOWS_DEMAND))

    @property
    def free_milli(self) -> int:
        """What is left of it for a whole-GPU or shared placement, in thousandths (MIG: 0)."""
        if self.mode == MIG or self.exclusive_busy:
            return 0
        if self.mps_used_threads or self.mps_used_mib:
            return max(0, MILLI - 10 * self.mps_used_threads)
        if self.replicas_used:
            return (self.replicas - len(self.replicas_used)) * (MILLI // max(1, self.replicas))
        return MILLI


@dataclass
class HostState:
    name: str
    up: bool
    gpus: list[GpuState] = field(default_factory=list)
    # CPU and memory the host offers sandboxes, and what placed sandboxes take of it.
    # A capacity of 0 means "not tracked": the host never refuses for lack of it.
    cpu_milli: int = 0
    memory_mib: int = 0
    cpu_used_milli: int = 0
    memory_used_mib: int = 0
    # Isolation levels its agent's sandbox driver gives (container, process, vm); () = any.
    isolation_levels: tuple[str, ...] = ()
    # The engine cluster it belongs to, whose jobs may span several of its hosts (a Slurm
    # cluster: scheduler.placement.gang); "" for a host that runs its sandboxes alone.
    cluster: str = ""
    # How its GPUs are linked (NVLink, PCIe) and their NUMA nodes, by GPU index: which of its
    # idle GPUs a multi-GPU request takes (scheduler.topology); none reported: the first ones.
    topology: Topology = NO_TOPOLOGY

    def has_room(self, cpu_milli: int, memory_mib: int) -> bool:
        return (not self.cpu_milli or self.cpu_used_milli + cpu_milli <= self.cpu_milli) and (
            not self.memory_mib or self.memory_used_mib + memory_mib <= self.memory_mib
        )

    def take(self, cpu_milli: int, memory_mib: int, sign: int = 1) -> None:
        """Book (sign 1) or give back (sign -1) a sandbox's CPU and memory."""
        self.cpu_used_milli += sign * cpu_milli
        self.memory_used_mib += sign * memory_mib


_EPOCHS = itertools.count()


@dataclass
class Snapshot:
    hosts: list[HostState]
    # What holds the busy devices above. Optional: without it the cycle can neither preempt,
    # count quota use, nor tell when capacity frees up for a reservation.
    running: list[Running] = field(default_factory=list)
    # Which snapshot this is, and the hosts changed in it since, in order (``changed``):
    # a policy that keeps per-host scores between calls re-scores only those.
    epoch: int = field(default_factory=lambda: next(_EPOCHS))
    changes: list[str] = field(default_factory=list)

    def copy(self) -> Snapshot:
        # Running entries are frozen, so sharing them between copies is safe (and cheap).
        return Snapshot(hosts=copy.deepcopy(self.hosts), running=list(self.running))

    def changed(self, host: str) -> None:
        """Say that something on ``host`` (its GPUs, CPU, memory, availability) changed.

        Whoever books, releases or hides capacity in a snapshot that a policy is placing
        on calls this, so the policy's remembered scores for that host are dropped.
        """
        self.changes.append(host)


@dataclass(frozen=True)
class Request:
    id: int
    project: str
    priority: int
    submitted_at: float  # epoch seconds
    mode: str
    gpu_count: int = 1
    mig_profile: str = ""
    mps_memory_mib: int = 0
    mps_thread_pct: int = 0
    # The longest it may run (the tier's max duration); 0 when unknown. Backfill only lets
    # a request of known length run on devices reserved for the queue head.
    max_duration_s: float = 0.0
    cpu_milli: int = 0  # host CPU the sandbox is limited to (its tier's), in thousandths of a core
    memory_mib: int = 0  # host memory it is limited to
    isolation: str = ""  # container, process or vm; "" when any host will do (trace replay)
    gpu_models: tuple[str, ...] = ()  # GPU models it accepts; () for any
    nodes: int = 1  # hosts it spans, gpu_count whole GPUs on each (a multi-node Slurm job)

    @property
    def gpu_milli(self) -> int:
        """Thousandths of each GPU it takes (a time-slice replica's share depends on the
        GPU: counted as a quarter here); 0 for MIG and CPU-only requests."""
        if self.mode == DEDICATED:
            return MILLI
        if self.mode == MPS:
            return max(1, self.mps_thread_pct * 10)
        if self.mode == TIMESLICE:
            return MILLI // 4
        return 0


@dataclass(frozen=True)
class DeviceGrant:
    gpu_uuid: str
    device_uuid: str  # what the sandbox sees (GPU or MIG UUID)
    kind: str  # exclusive | mig | mps | timeslice
    milli_gpu: int
    mig_uuid: str = ""
    mps_memory_mib: int = 0
    mps_thread_pct: int = 0
    replica: int | None = None


@dataclass(frozen=True)
class Running:
    """A placed sandbox still holding its devices (placing, starting or running)."""

    sandbox_id: int
    project: str
    host: str
    grants: tuple[DeviceGrant, ...]
    priority: int = 0
    started_at: float = 0.0
    ends_at: float | None = None  # start + max duration; None when unbounded
    preemptible: bool = False
    borrowed: bool = False  # placed over its project's guarantee: reclaimable
    # Before this time (its start + its tier's minimum runtime) nothing preempts it, neither
    # a higher priority nor a reclaim.
    preemptible_at: float = 0.0
    warning_s: float = 0.0  # a preemption warns it this long before its stop (its tier's grace)
    cpu_milli: int = 0
    memory_mib: int = 0

    @cached_property
    def milli_gpu(self) -> int:
        # Cached: quotas and the fair order sum it over every holder, every cycle and preview.
        return sum(g.milli_gpu for g in self.grants)


@dataclass(frozen=True)
class ModelLimit:
    """A project's cap on some GPU models (scheduler/model_quotas.py): one model, or a class
    of models an admin names, in milli-GPU held at once."""

    name: str  # the model, or the class's name
    models: frozenset[str]
    limit_milli: int | None  # None: no cap on what it holds at once
    closed: str = ""  # why nothing more may start on them (GPU-hours used up); "" if open


@dataclass(frozen=True)
class ProjectShare:
    """One project's say in the fair share and its quota, in milli-GPU (1000 = one GPU)."""

    weight: float = 1.0
    guaranteed_milli: int | None = None  # None: no guarantee, nothing it runs is borrowed
    limit_milli: int | None = None  # None: no ceiling
    usage_gpu_s: float = 0.0  # decayed GPU-seconds, as of FairShareState.usage_at
    model_limits: tuple[ModelLimit, ...] = ()
    department: str | None = None  # the department it belongs to (FairShareState.departments)


@dataclass(frozen=True)
class DepartmentShare:
    """A department: an organisational unit above projects (an institute, a group), in a tree
    (scheduler/departments.py). Its guarantee and ceiling bound what all of its projects hold
    together; its weight is its say against its siblings in the fair share."""

    parent: str | None = None
    weight: float = 1.0
    # None: the sum of its children's guarantees (it guarantees what they do, nothing more).
    guaranteed_milli: int | None = None
    limit_milli: int | None = None  # None: no ceiling of its own
    model_limits: tuple[ModelLimit, ...] = ()


@dataclass(frozen=True)
class FairShareState:
    projects: dict[str, ProjectShare] = field(default_factory=dict)
    departments: dict[str, DepartmentShare] = field(default_factory=dict)
    half_life_s: float = 7 * 86400.0
    usage_at: float | None = None  # when usage_gpu_s was last decayed; None: at ``now``
    # Allocations count against their project as the usage they will add over this horizon,
    # so one cycle does not hand every free GPU to whoever was furthest behind.
    horizon_s: float = 3600.0

    def share(self, project: str) -> ProjectShare:
        return self.projects.get(project, _DEFAULT_SHARE)


_DEFAULT_SHARE = ProjectShare()


@dataclass(frozen=True)
class Place:
    request_id: int
    host: str
    grants: tuple[DeviceGrant, ...]
    borrowed: bool = False  # over the project's guarantee: record it, it may be reclaimed


@dataclass(frozen=True)
class Pending:
    request_id: int
    reason: str


@dataclass(frozen=True)
class Preempt:
    """Stop this sandbox now; a Place later in the same list reuses its devices."""

    sandbox_id: int
    reason: str


@dataclass(frozen=True)
class Reserve:
    """The queue head starts on these devices at ``at`` at the latest; backfill keeps off them."""

    request_id: int
    host: str
    at: float
    grants: tuple[DeviceGrant, ...] = ()


Decision = Place | Pending | Preempt | Reserve


def book(gpu: GpuState, grant: DeviceGrant) -> None:
    """Mark ``grant`` as taken on ``gpu``."""
    _set(gpu, grant, taken=True)


def release(gpu: GpuState, grant: DeviceGrant) -> None:
    """Give ``grant`` back on ``gpu``; the exact inverse of ``book``."""
    _set(gpu, grant, taken=False)


def _set(gpu: GpuState, grant: DeviceGrant, taken: bool) -> None:
    if grant.kind == "exclusive":
        gpu.exclusive_busy = taken
    elif grant.kind == "mig":
        for slot in gpu.mig:
            if slot.uuid == grant.mig_uuid:
                slot.busy = taken
    elif grant.kind == "mps":
        sign = 1 if taken else -1
        gpu.mps_used_mib += sign * grant.mps_memory_mib
        gpu.mps_used_threads += sign * grant.mps_thread_pct
        if taken and gpu.mps_share is None:
            gpu.mps_share = (grant.mps_memory_mib, grant.mps_thread_pct)
        elif not taken and gpu.mps_used_mib <= 0 and gpu.mps_used_threads <= 0:
            gpu.mps_share = None  # its last share gone: the next may be of any size
    elif grant.kind == "timeslice" and grant.replica is not None:
        if taken:
            gpu.replicas_used.add(grant.replica)
        else:
            gpu.replicas_used.discard(grant.replica)
