"""A GPU backend with no GPU: models H100/A100 devices for demos and tests.

What it models, and why each piece is there:

* MIG geometry from ``scheduler.gpus``, so a placement the scheduler thinks legal is the
  one this backend accepts, and an illegal one fails the way NVML would.
* Load that sandboxes report through ``note_load``: utilization and memory held per owner
  (``util_by_owner``, ``mem_by_owner``: keyed by owner, where NVML keys by pid) and, from
  them, power, a first-order thermal response and clocks. The thermal state is solved
  exactly between two instants, so the curve is the same whether the agent samples every
  0.1 s or every 10 s.
* Deterministic UUIDs from (host, index) and MIG UUIDs from (parent, GPU instance id), so
  the device a sandbox recorded is still there, under the same name, after an agent restart.

Everything here says ``simulated=True``: the UI shows it, and nothing simulated passes for real.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.gpus import CATALOG, COMPUTE_SLICES, GpuModel, check_layout
from workers.gpu.base import (
    COMPUTE_DEFAULT,
    COMPUTE_MODES,
    FaultEvent,
    GpuBackendError,
    GpuInfo,
    GpuLost,
    GpuSample,
    MemoryRepairs,
    MigDevice,
    xid_event,
)
from workers.gpu.simulated_topology import simulated_topology

# Fixed namespace so UUIDs are stable across processes and releases.
_UUID_NAMESPACE = uuidlib.UUID("6f1d2c1e-5a7b-4c59-9a43-0b6d5f3e8a21")

# What NVML reports as the device name for each canonical model.
_MARKETING_NAMES = {
    "H100-80GB": "NVIDIA H100 80GB HBM3",
    "A100-80GB": "NVIDIA A100-SXM4-80GB",
    "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "H200": "NVIDIA H200",
    "H100-PCIe": "NVIDIA H100 PCIe",
    "H100-NVL": "NVIDIA H100 NVL",
    "H800-80GB": "NVIDIA H800",
    "GH200-96GB": "NVIDIA GH200 480GB",
    # The Alibaba trace's models, for the cluster twin's simulated hosts.
    "P100": "Tesla P100-PCIE-16GB",
    "T4": "Tesla T4",
    "V100M16": "Tesla V100-SXM2-16GB",
    "V100M32": "Tesla V100-SXM2-32GB",
    "A10": "NVIDIA A10",
    "G1": "Alibaba trace G1 (anonymised)",
    "G2": "Alibaba trace G2 (anonymised)",
    "G3": "Alibaba trace G3 (anonymised)",
}

DRIVER_OVERHEAD_MIB = 512  # what the driver holds on an idle whole GPU
MIG_OVERHEAD_MIB = 16  # an idle MIG device reports a few MiB in use

IDLE_TEMP_C = 33.0
FULL_LOAD_TEMP_C = 76.0
THERMAL_TAU_S = 25.0
THROTTLE_TEMP_C = 85.0  # software thermal slowdown from here
HW_SLOWDOWN_TEMP_C = 92.0
IDLE_CLOCK_FRACTION = 0.18  # idle SM clock as a share of max (H100: ~350 MHz)


@dataclass(frozen=True)
class SimulatedGpuConfig:
    model: str  # a key of scheduler.gpus.CATALOG (the trace's models too)
    mig: bool = False
    mig_layout: tuple[tuple[str, int], ...] = ()  # (profile name, start); () = default


def default_mig_layout(model: str) -> tuple[tuple[str, int], ...]:
    """A legal layout that uses every memory and compute slice: 3g@4, 2g@0, 1g@2, 1g@3.

    Mixed sizes on purpose, so demos show small and large slices side by side.
    """
    gpu_model = _model(model)
    if not gpu_model.mig_capable:
        raise ValueError(f"{model} does not support MIG")
    wanted = ((3, 4, 4), (2, 2, 0), (1, 1, 2), (1, 1, 3))  # (compute, memory slices, start)
    layout = []
    for compute, memory, start in wanted:
        profile = next(
            p for p in gpu_model.mig_profiles if p.compute_slices == compute and p.memory_slices == memory
        )
        layout.append((profile.name, start))
    return tuple(layout)


def parse_sim_spec(text: str) -> list[SimulatedGpuConfig]:
    """Parse e.g. ``"H100-80GB:4:mig=0,1;A100-80GB:2"`` into one config per GPU.

    Groups are separated by ``;``; each is ``MODEL[:COUNT][:mig=I,J,...]`` where the
    ``mig`` indices count within the group (0 is the group's first GPU). MIG GPUs start
    with ``default_mig_layout``.
    """
    configs: list[SimulatedGpuConfig] = []
    for raw_group in text.split(";"):
        group = raw_group.strip()
        if not group:
            continue
        parts = [part.strip() for part in group.split(":")]
        model = parts[0]
        _model(model)
        count = 1
        mig_indices: set[int] = set()
        for part in parts[1:]:
            if part.startswith("mig="):
                try:
                    mig_indices = {int(i) for i in part[4:].split(",") if i.strip()}
                except ValueError:
                    raise ValueError(f"bad MIG indices in {group!r}") from None
            else:
                try:
                    count = int(part)
                except ValueError:
                    raise ValueError(f"bad GPU count {part!r} in {group!r}") from None
        if count < 1:
            raise ValueError(f"GPU count must be at least 1 in {group!r}")
        bad = sorted(i for i in mig_indices if not 0 <= i < count)
        if bad:
            raise ValueError(f"MIG indices {bad} out of range 0..{count - 1} in {group!r}")
        if mig_indices and not _model(model).mig_capable:
            raise ValueError(f"{model} does not support MIG ({group!r})")
        configs.extend(SimulatedGpuConfig(model, mig=i in mig_indices) for i in range(count))
    return configs


def gpu_uuid(host: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{host}/{index}')}"


def mig_uuid(parent_uuid: str, gpu_instance_id: int) -> str:
    return f"MIG-{uuidlib.uuid5(_UUID_NAMESPACE, f'{parent_uuid}/gi{gpu_instance_id}')}"


def gpu_instance_id(memory_slices: int, start: int) -> int:
    """GPU instance id for a placement, numbered the way NVML numbers them on A100/H100.

    The full GPU is 0, half-GPU placements 1-2, quarter placements 3-6, eighths 7-13. Tying
    the id (and so the MIG UUID) to the placement keeps it stable when an agent restarts
    and rebuilds the same layout in another order.
    """
    first_id = {8: 0, 4: 1, 2: 3, 1: 7}[memory_slices]
    return first_id + start // memory_slices


def _model(name: str) -> GpuModel:
    """A model the platform runs on, or one of the Alibaba trace's (the cluster twin's)."""
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown GPU model {name!r}; known: {', '.join(CATALOG)}") from None


@dataclass
class _Load:
    device_uuids: tuple[str, ...]
    mem_mib: int  # per device
    util_pct: float  # per device, in that device's own terms


@dataclass
class _Gpu:
    index: int
    uuid: str
    model: GpuModel
    mig_enabled: bool
    temp_offset_c: float  # per-board spread, so a fleet of idle GPUs does not look cloned
    temp_c: float
    last_t: float
    migs: dict[str, MigDevice] = field(default_factory=dict)  # by MIG uuid
    lost: bool = False
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0


class SimulatedBackend:
    name = "simulated"
    simulated = True

    def __init__(
        self,
        host: str,
        gpus: list[SimulatedGpuConfig],
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        mig_util_unmeasured: bool = False,
    ) -> None:
        """``mig_util_unmeasured``: MIG devices and GPUs in MIG mode report no utilization
        (util_pct None), as NVML does on a GPU without GPM (an A100), for tests of what
        consumers do with an unmeasured device. Off by default: demos show numbers."""
        self._host = host
        self._mig_util_unmeasured = mig_util_unmeasured
        self._seed = seed
        self._clock = clock
        # The agent samples from its own thread while task threads launch sandboxes.
        self._lock = threading.RLock()
        self._gpus: dict[str, _Gpu] = {}
        self._mig_parent: dict[str, str] = {}  # MIG uuid -> GPU uuid
        self._loads: dict[str, _Load] = {}
        self._events: list[FaultEvent] = []
        # What set_fabric_problem / set_memory_repairs put on a GPU (none: ready and clean).
        self._not_ready: dict[str, str] = {}
        self._repairs: dict[str, MemoryRepairs] = {}
        # Compute mode per GPU or MIG device, as NVML keeps it (a MIG device's is its own);
        # absent: DEFAULT. ``refuse_compute_mode`` makes a device refuse to change it.
        self._compute_modes: dict[str, str] = {}
        self.refuse_compute_mode: set[str] = set()
        now = clock()
        for index, config in enumerate(gpus):
            model = _model(config.model)
            if config.mig and not model.mig_capable:
                raise ValueError(f"GPU {index}: {model.name} does not support MIG")
            if config.mig_layout and not config.mig:
                raise ValueError(f"GPU {index}: a MIG layout needs mig=True")
            uuid = gpu_uuid(host, index)
            offset = random.Random(f"{seed}:{uuid}:offset").uniform(-1.5, 1.5)  # noqa: S311 - fake sensor
            gpu = _Gpu(index, uuid, model, config.mig, offset, IDLE_TEMP_C + offset, now)
            self._gpus[uuid] = gpu
            if config.mig:
                for profile, start in config.mig_layout or default_mig_layout(model.name):
                    try:
                        self._create_mig(gpu, profile, start)
                    except GpuBackendError as err:
                        raise ValueError(f"GPU {index}: bad MIG layout: {err}") from None
        # NUMA node and links by GPU index: fixed, as a real host's boards are.
        self._topology = simulated_topology([config.model for config in gpus])

    # -- inventory and MIG -------------------------------------------------------------

    def list_gpus(self) -> list[GpuInfo]:
        with self._lock:
            return [
                GpuInfo(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    name=_MARKETING_NAMES[gpu.model.name],
                    model=gpu.model.name,
                    memory_mib=gpu.model.memory_mib,
                    mig_enabled=gpu.mig_enabled,
                    mig_devices=tuple(self._sorted_migs(gpu)),
                    simulated=True,
                    not_ready=self._not_ready.get(gpu.uuid, ""),
                    numa_node=self._topology[gpu.index][0],
                    links=self._topology[gpu.index][1],
                )
                for gpu in self._gpus.values()
                if not gpu.lost  # as with NVML, a GPU that fell off the bus is gone
            ]

    def mig_layout(self, uuid: str) -> list[MigDevice]:
        with self._lock:
            return self._sorted_migs(self._gpu(uuid))

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice:
        with self._lock:
            return self._create_mig(self._gpu(uuid), profile, start)

    def destroy_mig(self, uuid: str, mig_uuid: str) -> None:
        with self._lock:
            gpu = self._gpu(uuid)
            if mig_uuid not in gpu.migs:
                raise GpuBackendError(f"{mig_uuid} is not a MIG device of {uuid}")
            users = sorted(o for o, load in self._loads.items() if mig_uuid in load.device_uuids)
            if users:
                # NVML refuses too (NVML_ERROR_IN_USE) while processes run on the instance.
                raise GpuBackendError(f"{mig_uuid} is in use by {', '.join(users)}")
            del gpu.migs[mig_uuid]
            del self._mig_parent[mig_uuid]
            self._compute_modes.pop(mig_uuid, None)  # a new instance (same uuid) starts DEFAULT

    def _create_mig(self, gpu: _Gpu, profile_name: str, start: int) -> MigDevice:
        if not gpu.mig_enabled:
            raise GpuBackendError(f"MIG mode is disabled on {gpu.uuid}")
        try:
            profile = gpu.model.profile(profile_name)
        except KeyError:
            known = ", ".join(p.name for p in gpu.model.mig_profiles)
            raise GpuBackendError(
                f"{gpu.model.name} has no MIG profile {profile_name!r} (known: {known})"
            ) from None
        if start not in profile.starts:
            raise GpuBackendError(
                f"{profile_name} cannot start at memory slice {start} on {gpu.model.name}; "
                f"legal starts: {', '.join(map(str, profile.starts))}"
            )
        wanted = set(profile.slots(start))
        for mig in gpu.migs.values():
            if wanted.intersection(range(mig.start, mig.start + mig.memory_slices)):
                raise GpuBackendError(
                    f"{profile_name}@{start} overlaps {mig.profile}@{mig.start} ({mig.uuid})"
                )
        # Beyond memory slices: at most 7 compute slices and one +me instance, as NVML
        # refuses (INSUFFICIENT_RESOURCES) a GPU instance the hardware cannot back.
        problems = check_layout(
            gpu.model, [*((m.profile, m.start) for m in gpu.migs.values()), (profile_name, start)]
        )
        if problems:
            raise GpuBackendError(f"{profile_name}@{start} on {gpu.uuid}: {'; '.join(problems)}")
        gi_id = gpu_instance_id(profile.memory_slices, start)
        mig = MigDevice(
            uuid=mig_uuid(gpu.uuid, gi_id),
            parent_uuid=gpu.uuid,
            profile=profile.name,
            start=start,
            memory_slices=profile.memory_slices,
            memory_mib=profile.memory_mib,
            gpu_instance_id=gi_id,
            compute_instance_id=0,  # NVML numbers compute instances from 0 within each GI
        )
        gpu.migs[mig.uuid] = mig
        self._mig_parent[mig.uuid] = gpu.uuid
        return mig

    # -- load ------------------------------------------------------------------------------

    def note_load(self, owner: str, device_uuids: list[str], mem_mib: int, util_pct: float) -> None:
        """``owner`` runs on each of ``device_uuids`` with this memory and utilization each."""
        with self._lock:
            for device in device_uuids:
                self._device(device)  # unknown device -> GpuBackendError
            # Bring temperatures up to now under the old load before it changes.
            self._advance_all()
            self._loads[owner] = _Load(tuple(device_uuids), max(0, mem_mib), _pct(util_pct))

    def forget_load(self, owner: str) -> None:
        with self._lock:
            self._advance_all()
            self._loads.pop(owner, None)

    # -- telemetry -------------------------------------------------------------------------

    def sample(self, uuid: str) -> GpuSample:
        with self._lock:
            gpu, mig = self._device(uuid)
            if gpu.lost:
                raise GpuLost(f"sample: {uuid} is lost", gpu.uuid)
            now = self._clock()
            self._advance(gpu, now)
            gpu_util = self._gpu_util(gpu)
            power_w = self._power(gpu, gpu_util)
            throttle = self._throttle(gpu, power_w, gpu_util)
            noisy_power = power_w * (1 + self._noise(gpu.uuid, now, "power", 0.01))
            clock_mhz = self._sm_clock(gpu, gpu_util, throttle, now)
            temp_c = gpu.temp_c + self._noise(gpu.uuid, now, "temp", 0.3)
            if mig is None:
                util = gpu_util
                by_owner = self._mem_by_owner(lambda d: d == gpu.uuid or d in gpu.migs)
                overhead, total = DRIVER_OVERHEAD_MIB, gpu.model.memory_mib
            else:
                util = _pct(sum(ld.util_pct for ld in self._loads.values() if uuid in ld.device_uuids))
                by_owner = self._mem_by_owner(lambda d: d == uuid)
                overhead, total = MIG_OVERHEAD_MIB, mig.memory_mib
            if util > 0:
                util = _pct(util + self._noise(uuid, now, "util", 2.0))
            unmeasured = self._mig_util_unmeasured and gpu.mig_enabled
            # As NVML: no per-process utilization on a MIG device nor on a GPU in MIG mode.
            util_by_owner = None if gpu.mig_enabled else self._util_by_owner(uuid)
            return GpuSample(
                uuid=uuid,
                t_ms=int(now * 1000),
                temp_c=round(temp_c, 1),
                util_pct=None if unmeasured else round(util, 1),
                mem_used_mib=min(total, overhead + sum(by_owner.values())),
                mem_total_mib=total,
                power_w=round(min(float(gpu.model.tdp_w), noisy_power), 1),
                sm_clock_mhz=clock_mhz,
                throttle=throttle,
                mem_by_owner=by_owner,
                util_by_owner=util_by_owner,
                ecc_corrected=gpu.ecc_corrected,
                ecc_uncorrected=gpu.ecc_uncorrected,
            )

    def _gpu_util(self, gpu: _Gpu) -> float:
        """Whole-GPU utilization: a MIG device's load counts by its share of compute slices."""
        total = 0.0
        for load in self._loads.values():
            for device in load.device_uuids:
                if device == gpu.uuid:
                    total += load.util_pct
                elif device in gpu.migs:
                    profile = gpu.model.profile(gpu.migs[device].profile)
                    total += load.util_pct * profile.compute_slices / COMPUTE_SLICES
        return _pct(total)

    def _util_by_owner(self, uuid: str) -> dict[str, float]:
        """Each owner's share of a whole GPU's time: what it asked for, or, when the owners
        together ask for more than all of it (time-slicing), their requests scaled down to
        fit, as the GPU's time slices divide it."""
        wanted = {o: ld.util_pct for o, ld in self._loads.items() if uuid in ld.device_uuids}
        scale = min(1.0, 100.0 / total) if (total := sum(wanted.values())) > 0 else 1.0
        return {owner: round(util * scale, 1) for owner, util in wanted.items()}

    def _mem_by_owner(self, on_device: Callable[[str], bool]) -> dict[str, int]:
        held: dict[str, int] = {}
        for owner, load in self._loads.items():
            mem = load.mem_mib * sum(1 for d in load.device_uuids if on_device(d))
            if mem:
                held[owner] = mem
        return held

    def _power(self, gpu: _Gpu, util: float) -> float:
        model = gpu.model
        return model.idle_w + (model.tdp_w - model.idle_w) * util / 100

    def _throttle(self, gpu: _Gpu, power_w: float, util: float) -> tuple[str, ...]:
        # Names match NvmlBackend's decoding of the clock event reason bits.
        reasons = []
        if util < 1:
            reasons.append("gpu_idle")
        if gpu.model.tdp_w > 0 and power_w >= 0.98 * gpu.model.tdp_w:  # 0: unknown (G1-G3)
            reasons.append("sw_power_cap")
        if gpu.temp_c >= THROTTLE_TEMP_C:
            reasons.append("sw_thermal")
        if gpu.temp_c >= HW_SLOWDOWN_TEMP_C:
            reasons.append("hw_slowdown")
        return tuple(reasons)

    def _sm_clock(self, gpu: _Gpu, util: float, throttle: tuple[str, ...], now: float) -> int:
        top = gpu.model.max_sm_clock_mhz
        if util < 1:
            return round(top * IDLE_CLOCK_FRACTION)
        clock = top * (0.93 + 0.07 * util / 100)  # boost holds near max under any real load
        if "sw_thermal" in throttle:
            clock *= 0.85
        if "hw_slowdown" in throttle:
            clock *= 0.6
        return round(clock * (1 + self._noise(gpu.uuid, now, "clock", 0.005)))

    def _equilibrium(self, gpu: _Gpu) -> float:
        model = gpu.model
        if model.tdp_w > model.idle_w:
            power_frac = (self._power(gpu, self._gpu_util(gpu)) - model.idle_w) / (model.tdp_w - model.idle_w)
        else:  # power unknown (the trace's anonymised models): heat follows the load
            power_frac = self._gpu_util(gpu) / 100
        return IDLE_TEMP_C + gpu.temp_offset_c + (FULL_LOAD_TEMP_C - IDLE_TEMP_C) * power_frac

    def _advance(self, gpu: _Gpu, now: float) -> None:
        """Solve dT/dt = (T_eq - T) / tau exactly over [last_t, now] with the current load."""
        dt = now - gpu.last_t
        if dt > 0:
            target = self._equilibrium(gpu)
            gpu.temp_c = target + (gpu.temp_c - target) * math.exp(-dt / THERMAL_TAU_S)
            gpu.last_t = now

    def _advance_all(self) -> None:
        now = self._clock()
        for gpu in self._gpus.values():
            self._advance(gpu, now)

    def _noise(self, uuid: str, now: float, what: str, amplitude: float) -> float:
        """Seeded noise keyed by device, quantity and 100 ms tick.

        Keyed rather than drawn from one stream, so the value does not depend on how
        threads interleave their sample calls.
        """
        key = f"{self._seed}:{uuid}:{what}:{int(now * 10)}"
        return random.Random(key).uniform(-amplitude, amplitude)  # noqa: S311 - fake sensor noise

    # -- faults ----------------------------------------------------------------------------

    def fault_events(self) -> list[FaultEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def inject_xid(self, uuid: str, xid: int) -> None:
        """Queue an XID error on a GPU or MIG device, as NVML's event set would report it."""
        with self._lock:
            self._device(uuid)
            self._events.append(xid_event(uuid, xid, self._now_ms()))  # app_xid or xid

    def inject_ecc(self, uuid: str, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors on the board behind ``uuid``; uncorrected ones also raise an
        ``ecc_dbe`` event for that device, as NVML's double-bit ECC event does."""
        with self._lock:
            gpu, _ = self._device(uuid)
            gpu.ecc_corrected += corrected
            gpu.ecc_uncorrected += uncorrected
            if uncorrected:
                detail = f"{uncorrected} double-bit ECC error(s)"
                self._events.append(FaultEvent(uuid, "ecc_dbe", detail, self._now_ms()))

    def inject_overheat(self, uuid: str, temp_c: float) -> None:
        """Set the GPU's temperature now; it relaxes back toward equilibrium from there. A
        GPU reports its temperature, not a fault: the alert policy's temperature rule (on
        the agent) decides when it is too hot, as it does for a real GPU."""
        with self._lock:
            gpu, _ = self._device(uuid)
            self._advance(gpu, self._clock())
            gpu.temp_c = temp_c

    def mark_lost(self, uuid: str) -> None:
        """The GPU fell off the bus: it leaves the inventory and every call on it fails."""
        with self._lock:
            gpu, _ = self._device(uuid)
            if not gpu.lost:
                gpu.lost = True
                self._events.append(FaultEvent(gpu.uuid, "gpu_lost", "GPU is lost", self._now_ms()))

    def fabric_problem(self, uuid: str) -> str:
        with self._lock:
            gpu, _ = self._device(uuid)
            return self._not_ready.get(gpu.uuid, "")

    def memory_repairs(self, uuid: str) -> MemoryRepairs:
        with self._lock:
            gpu, _ = self._device(uuid)
            return self._repairs.get(
                gpu.uuid, MemoryRepairs(remapped_uncorrectable=0, remapped_correctable=0)
            )

    def set_fabric_problem(self, uuid: str, problem: str) -> None:
        """The GPU's NVLink fabric is not ready for ``problem`` ("": ready again), as NVML
        reports a GPU Fabric Manager has not registered (nvml_board.fabric_problem)."""
        with self._lock:
            gpu, _ = self._device(uuid)
            self._not_ready[gpu.uuid] = problem

    def set_memory_repairs(self, uuid: str, repairs: MemoryRepairs) -> None:
        """The board's row-remapping / page-retirement state from now on."""
        with self._lock:
            gpu, _ = self._device(uuid)
            self._repairs[gpu.uuid] = repairs

    def compute_mode(self, uuid: str) -> str:
        with self._lock:
            self._device(uuid)
            return self._compute_modes.get(uuid, COMPUTE_DEFAULT)

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        if mode not in COMPUTE_MODES:
            raise GpuBackendError(f"no compute mode {mode!r}: one of {', '.join(COMPUTE_MODES)}")
        with self._lock:
            gpu, mig = self._device(uuid)
            if mig is None and gpu.mig_enabled:  # nvml.h: in MIG mode, only a MIG device handle
                raise GpuBackendError(
                    f"set compute mode {mode} on {uuid}: in MIG mode, set it per MIG device"
                )
            if uuid in self.refuse_compute_mode:
                raise GpuBackendError(f"set compute mode {mode} on {uuid}: Insufficient Permissions")
            self._compute_modes[uuid] = mode

    def close(self) -> None:
        """Nothing to release: all state lives in this object."""

    # -- lookups ---------------------------------------------------------------------------

    def _gpu(self, uuid: str) -> _Gpu:
        gpu = self._gpus.get(uuid)
        if gpu is None:
            raise GpuBackendError(f"no GPU {uuid} on simulated host {self._host}")
        if gpu.lost:
            raise GpuBackendError(f"{uuid} is lost")
        return gpu

    def _device(self, uuid: str) -> tuple[_Gpu, MigDevice | None]:
        """The GPU behind a GPU or MIG uuid, and the MIG device when it is one."""
        parent = self._mig_parent.get(uuid)
        if parent is not None:
            return self._gpus[parent], self._gpus[parent].migs[uuid]
        gpu = self._gpus.get(uuid)
        if gpu is None:
            raise GpuBackendError(f"no GPU or MIG device {uuid} on simulated host {self._host}")
        return gpu, None

    @staticmethod
    def _sorted_migs(gpu: _Gpu) -> list[MigDevice]:
        return sorted(gpu.migs.values(), key=lambda m: m.start)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def _pct(value: float) -> float:
    return max(0.0, min(100.0, float(value)))
