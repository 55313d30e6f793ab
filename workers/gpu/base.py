"""The GPU backend seam: what a host agent needs from a GPU, whether real or simulated.

``NvmlBackend`` (nvml.py) drives real GPUs through nvidia-ml-py; ``SimulatedBackend``
(simulated.py) models them for demos and tests. Both return these plain dataclasses, so
the agent, the telemetry publisher and the tests never know which one they talk to —
except through ``GpuBackend.simulated``, which the UI always shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class MigDevice:
    uuid: str  # "MIG-..." as CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES accept it
    parent_uuid: str
    profile: str  # e.g. "3g.40gb"
    start: int  # memory-slice placement start
    memory_slices: int
    memory_mib: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class GpuInfo:
    uuid: str
    index: int
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # canonical, e.g. "H100-80GB" ("" when unknown)
    memory_mib: int
    mig_enabled: bool
    mig_devices: tuple[MigDevice, ...] = ()
    simulated: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuSample:
    uuid: str
    t_ms: int  # epoch milliseconds when sampled
    temp_c: float
    util_pct: float
    mem_used_mib: int
    mem_total_mib: int
    power_w: float
    sm_clock_mhz: int
    throttle: tuple[str, ...] = ()  # e.g. ("sw_thermal", "hw_slowdown")
    # memory held by each process / sandbox key on this GPU, when the backend knows it;
    # NVML keys are "pid:<pid>", so the agent can map a pid to the sandbox that owns it
    mem_by_owner: dict[str, int] = field(default_factory=dict)
    # Volatile ECC error counts of the board (since the last driver load); 0 when the GPU
    # has no ECC or does not report it. A MIG device reports its parent's counts.
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0


@dataclass(frozen=True)
class HealthEvent:
    uuid: str
    kind: str  # "xid" | "ecc_dbe" | "gpu_lost" | "overheat"
    detail: str
    t_ms: int
    xid: int | None = None


class GpuBackendError(RuntimeError):
    """A backend operation that cannot be done (illegal MIG placement, unknown GPU...)."""


class GpuBackend(Protocol):
    name: str  # "nvml" | "simulated"
    simulated: bool

    def list_gpus(self) -> list[GpuInfo]: ...

    def sample(self, uuid: str) -> GpuSample: ...

    def mig_layout(self, uuid: str) -> list[MigDevice]: ...

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice: ...

    def destroy_mig(self, uuid: str, mig_uuid: str) -> None: ...

    def health_events(self) -> list[HealthEvent]: ...

    def note_load(self, owner: str, device_uuids: list[str], mem_mib: int, util_pct: float) -> None:
        """Tell the backend a sandbox now runs on these devices (real GPUs ignore this)."""

    def forget_load(self, owner: str) -> None:
        """The sandbox ``owner`` is gone (real GPUs ignore this)."""

    def close(self) -> None: ...
