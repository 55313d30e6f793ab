"""A snapshot of the fleet and of the queue: plain dataclasses the control worker fills in."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

DEDICATED, MIG, MPS, TIMESLICE = "dedicated", "mig", "mps", "timeslice"
MODES = (DEDICATED, MIG, MPS, TIMESLICE)


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
    mode: str  # how this GPU is shared, one of MODES
    available: bool = True  # False when drained or its host is lost
    exclusive_busy: bool = False
    mig: list[MigSlot] = field(default_factory=list)
    mps_used_mib: int = 0
    mps_used_threads: int = 0
    replicas: int = 0
    replicas_used: set[int] = field(default_factory=set)

    @property
    def idle(self) -> bool:
        """Nothing at all placed on it."""
        return not (
            self.exclusive_busy
            or any(s.busy for s in self.mig)
            or self.mps_used_threads
            or self.replicas_used
        )


@dataclass
class HostState:
    name: str
    up: bool
    gpus: list[GpuState] = field(default_factory=list)


@dataclass
class Snapshot:
    hosts: list[HostState]

    def copy(self) -> Snapshot:
        return copy.deepcopy(self)


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
class Place:
    request_id: int
    host: str
    grants: tuple[DeviceGrant, ...]


@dataclass(frozen=True)
class Pending:
    request_id: int
    reason: str


Decision = Place | Pending
