"""The GPU backend seam: what a host agent needs from a GPU, whether real or simulated.

``NvmlBackend`` (nvml.py) drives real GPUs through nvidia-ml-py; ``SimulatedBackend``
(simulated.py) models them for demos and tests. Both return these plain dataclasses, so
the agent, the telemetry publisher and the tests never know which one they talk to —
except through ``GpuBackend.simulated``, which the UI always shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from wire.xids import describe, is_application


@dataclass(frozen=True)
class MigDevice:
    uuid: str  # "MIG-..." as CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES accept it
    parent_uuid: str
    profile: str  # e.g. "3g.40gb"
    start: int  # memory-slice placement start
    memory_slices: int
    memory_mib: int
    gpu_instance_id: int
    compute_instance_id: int  # -1 when the GPU instance has no compute instance
    # Compute instances in the GPU instance. 1 is a device a sandbox can be given (uuid is
    # its MIG uuid); 0 (left by an operator's `-cgi` without `-C`, or a half-failed destroy)
    # or several (e.g. 2x 1c.3g.40gb) are not, but their GPU instance holds its memory slices
    # all the same: uuid is then "<GPU uuid>/gi<id>", which no CUDA call accepts.
    compute_instances: int = 1

    @property
    def usable(self) -> bool:
        return self.compute_instances == 1


@dataclass(frozen=True)
class GpuInfo:
    uuid: str
    index: int
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # canonical, e.g. "H100-80GB" ("" when unknown)
    memory_mib: int
    mig_enabled: bool
    mig_devices: tuple[MigDevice, ...] = ()  # the usable ones: one compute instance each
    simulated: bool = False
    # GPU instances with no or several compute instances (MigDevice.usable is False): no
    # sandbox can have them, but their memory slices are taken. mig_layout lists them too.
    unusable_mig: tuple[MigDevice, ...] = ()
    # Why the GPU, though present and answering NVML, cannot run CUDA work now ("" when it
    # can): on Hopper + NVSwitch a GPU serves CUDA only once Fabric Manager has registered
    # it in the NVLink fabric (until then every CUDA call fails with 802). The portal shows
    # the GPU unavailable with this reason, and it comes back by itself once it is "".
    not_ready: str = ""
    # How the engine that binds this GPU to jobs (Slurm's GRES) lets it be shared: a subset of
    # "dedicated", "mps", "timeslice" (scheduler.cluster.FOLLOWS_DEMAND); () when the agent
    # hands out the GPU itself, in any mode. And the time-slice replicas that engine cuts it
    # into (Slurm's shards per GPU); 0 when that is the admin's setting.
    engine_modes: tuple[str, ...] = ()
    engine_replicas: int = 0
    # Where it sits on the host (scheduler.topology): the NUMA node of its nearest CPUs, and
    # its link to each other GPU as (that GPU's index, a level of scheduler.topology.LEVELS).
    # None and (): not known (NVML cannot tell, or an engine's GPUs), so no preference.
    numa_node: int | None = None
    links: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuSample:
    uuid: str
    t_ms: int  # epoch milliseconds when sampled
    temp_c: float
    # None: not measured (NVML has no utilization for a MIG device or a GPU in MIG mode,
    # unless GPM reads it). Never 0 for "unknown": 0 means idle, and idle gets culled.
    util_pct: float | None
    mem_used_mib: int
    mem_total_mib: int
    power_w: float
    sm_clock_mhz: int
    throttle: tuple[str, ...] = ()  # e.g. ("sw_thermal", "hw_slowdown")
    # memory held by each process / sandbox key on this GPU, when the backend knows it;
    # NVML keys are "pid:<pid>", so the agent can map a pid to the sandbox that owns it
    mem_by_owner: dict[str, int] = field(default_factory=dict)
    # SM utilization (%) of each process / sandbox key over the last sample period, keyed as
    # mem_by_owner; None when the device cannot measure it per process (then a sandbox on a
    # shared GPU has no utilization of its own: unmeasured, never its neighbours' figure).
    util_by_owner: dict[str, float] | None = None
    # Volatile ECC error counts of the board (since the last driver load); 0 when the GPU
    # has no ECC or does not report it. A MIG device reports its parent's counts.
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0


@dataclass(frozen=True)
class FaultEvent:
    uuid: str  # the GPU, or the MIG device the fault was tied to
    # "xid" (a device XID: the GPU is drained) | "app_xid" (an application XID: the tenant's
    # own fault, for the sandbox's owner; the GPU stays in service) | "ecc_dbe" | "gpu_lost"
    # | "overheat" | "remap_failed" | "remap_pending" | "retirement_pending" (MemoryRepairs)
    kind: str
    detail: str
    t_ms: int
    xid: int | None = None


def xid_event(uuid: str, xid: int, t_ms: int) -> FaultEvent:
    """The fault event for ``xid``: ``app_xid`` or ``xid`` as wire.xids classes it."""
    kind = "app_xid" if is_application(xid) else "xid"
    return FaultEvent(uuid, kind, describe(xid), t_ms, xid=xid)


@dataclass(frozen=True)
class MemoryRepairs:
    """What a GPU's memory repair state says, read from the board (it persists in the
    InfoROM across driver loads, unlike the volatile ECC counts): row remapping (Ampere and
    later) and dynamic page retirement (before Ampere). None: the GPU does not report it.

    A row remap or a page retirement takes effect only at the next GPU reset (or, for pages,
    a driver reload): until then it is *pending*. The GPU is drained so it empties and can be
    reset (NVIDIA's page-retirement guide: no new CUDA context is made on a board whose
    double-bit error waits to be mapped out). A *failed* remap means a bank ran out of spare
    rows: a case for NVIDIA's RMA policy, i.e. replacing the board."""

    remapped_uncorrectable: int | None = None  # rows remapped for uncorrectable errors
    remapped_correctable: int | None = None  # rows remapped for correctable errors
    remap_pending: bool = False
    remap_failed: bool = False
    retired_pages_dbe: int | None = None  # pages retired for double-bit ECC errors
    retirement_pending: bool = False

    def faults(self) -> list[tuple[str, str]]:
        """(fault kind, what an operator should know) for each condition that takes the GPU
        out of service; [] for a healthy board. The kinds drain like an XID (portal.control.faults)."""
        found = []
        rows = (
            f" ({self.remapped_uncorrectable} rows remapped for uncorrectable errors, "
            f"{self.remapped_correctable} for correctable ones)"
            if self.remapped_uncorrectable is not None
            else ""
        )
        if self.remap_failed:
            found.append(
                ("remap_failed", f"the GPU needs replacement (RMA): a memory row could not be remapped{rows}")
            )
        if self.remap_pending:
            found.append(("remap_pending", f"reset the GPU when idle; sandboxes on it keep running{rows}"))
        if self.retirement_pending:
            pages = (
                f" ({self.retired_pages_dbe} pages retired for double-bit ECC errors)"
                if self.retired_pages_dbe
                else ""
            )
            found.append(
                (
                    "retirement_pending",
                    f"reset the GPU when idle to map the bad pages out; sandboxes on it keep running{pages}",
                )
            )
        return found


# Compute modes as the backends name them (nvml.h ``nvmlComputeMode_t``). MPS shares need
# EXCLUSIVE_PROCESS on their device (workers.gpu.mps): then the MPS server holds the device's
# one context, and a tenant who steers its CUDA past the MPS daemon gets no context at all
# instead of the whole device without limits.
COMPUTE_DEFAULT = "default"
COMPUTE_EXCLUSIVE_PROCESS = "exclusive_process"
COMPUTE_PROHIBITED = "prohibited"
COMPUTE_MODES = (COMPUTE_DEFAULT, COMPUTE_EXCLUSIVE_PROCESS, COMPUTE_PROHIBITED)


class GpuBackendError(RuntimeError):
    """A backend operation that cannot be done (illegal MIG placement, unknown GPU...)."""


class GpuNotSampled(GpuBackendError):
    """No sample of the device to give now, and nothing wrong with it: a Slurm node whose
    monitor has not written one lately. The sampler skips the device quietly."""


class GpuLost(GpuBackendError):
    """The GPU (or the board a MIG device lives on) is lost: NVML_ERROR_GPU_IS_LOST, or it
    fell off the bus. The backend has queued one ``gpu_lost`` fault event for it; the
    caller drops the GPU from what it samples until the next inventory."""

    def __init__(self, message: str, uuid: str) -> None:
        super().__init__(message)
        self.uuid = uuid  # the GPU's uuid (a MIG device's parent)


@runtime_checkable
class DevicesBoundElsewhere(Protocol):
    """A backend whose GPUs another engine hands to jobs (Slurm binds a job's GRES itself,
    and runs MPS daemons on its nodes): the agent's parts keep their picture of MPS shares
    but start no daemon and set no compute mode. The engine also knows the host's CPUs and
    memory, which the agent (elsewhere) does not."""

    devices_bound_elsewhere: bool

    def host_facts(self) -> tuple[int, int]:
        """(CPU cores, memory MiB) the host offers jobs."""
        ...


class GpuBackend(Protocol):
    name: str  # "nvml" | "simulated"
    simulated: bool

    def list_gpus(self) -> list[GpuInfo]: ...

    def sample(self, uuid: str) -> GpuSample:
        """Raises GpuLost for a lost GPU (or a MIG device on one), GpuBackendError otherwise."""

    def mig_layout(self, uuid: str) -> list[MigDevice]: ...

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice: ...

    def destroy_mig(self, uuid: str, mig_uuid: str) -> None: ...

    def fault_events(self) -> list[FaultEvent]:
        """The device faults (XIDs, ECC, a lost GPU) since the last call. What goes wrong
        with a GPU is a fault: "health" is only the portal's ``/healthz``."""
        ...

    def fabric_problem(self, uuid: str) -> str:
        """Why the GPU cannot run CUDA work now for its NVLink fabric (GpuInfo.not_ready), or
        "" when it can (ready, or no fabric). Cheap enough to ask every heartbeat."""
        ...

    def memory_repairs(self, uuid: str) -> MemoryRepairs:
        """The GPU's row-remapping and page-retirement state (not its MIG devices': a
        board's). Raises GpuLost for a lost GPU."""
        ...

    def note_load(self, owner: str, device_uuids: list[str], mem_mib: int, util_pct: float) -> None:
        """Tell the backend a sandbox now runs on these devices (real GPUs ignore this)."""

    def forget_load(self, owner: str) -> None:
        """The sandbox ``owner`` is gone (real GPUs ignore this)."""

    def compute_mode(self, uuid: str) -> str:
        """The compute mode (one of ``COMPUTE_MODES``) of a whole GPU or of one MIG device: in
        MIG mode each MIG device has its own (nvml.h). GpuBackendError when it cannot be read."""
        ...

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Set it (root), on the MIG device itself for a MIG uuid. GpuBackendError when the
        driver refuses; the caller reads it back (``compute_mode``) to know it holds."""

    def close(self) -> None: ...
