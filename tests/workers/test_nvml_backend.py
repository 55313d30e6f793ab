"""NvmlBackend against a fake of exactly the pynvml functions it calls.

The fake holds two GPUs: an H100 with MIG disabled and an A100-80GB in MIG mode with a
2g.20gb@0 and a 3g.40gb@4 instance. Every other ``pynvml.nvml*`` function is replaced by a
trap, so a call the fake does not model fails the test instead of reaching a real driver.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from workers.gpu import make_backend
from workers.gpu import nvml as nvml_module
from workers.gpu.base import GpuBackendError
from workers.gpu.nvml import NvmlBackend, decode_clock_reasons, nvml_available

MIB = 1024 * 1024
NO_INSTANCE = 0xFFFFFFFF
H100_UUID = "GPU-11111111-1111-1111-1111-111111111111"
A100_UUID = "GPU-22222222-2222-2222-2222-222222222222"

# What an A100-80GB answers for each GPU instance profile enum: (id, name, slices, size).
A100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.10gb", 1, 1, 9728),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "MIG 2g.20gb", 2, 2, 19968),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "MIG 3g.40gb", 3, 4, 40192),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "MIG 4g.40gb", 4, 4, 40192),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.80gb", 7, 8, 80896),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "MIG 1g.10gb+me", 1, 1, 9728),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "MIG 1g.20gb", 1, 2, 19968),
}
A100_BY_ID = {p[0]: p for p in A100_PROFILES.values()}


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml turns the code into its NVMLError_* subclass


@dataclass(eq=False)
class Dev:
    uuid: str
    name: str = ""
    memory_mib: int = 0
    used_mib: int = 0
    mig_mode: int | None = pynvml.NVML_DEVICE_MIG_DISABLE  # None: MIG not supported
    temp: int = 41
    util: int = 55
    power_mw: int = 312_500
    sm_clock: int = 1755
    reasons: int = 0
    events_supported: int = 0
    procs: list[SimpleNamespace] = field(default_factory=list)
    parent: Dev | None = None  # set on MIG device handles
    gi_id: int = 0
    ci_id: int = 0


@dataclass(eq=False)
class ComputeInstance:
    id: int
    mig: Dev


@dataclass(eq=False)
class GpuInstance:
    parent: Dev
    id: int
    profile_id: int
    start: int
    size: int
    cis: dict[int, ComputeInstance] = field(default_factory=dict)


class FakeNvml:
    FUNCTIONS = frozenset(
        {
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetName",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetMigMode",
            "nvmlDeviceGetMaxMigDeviceCount",
            "nvmlDeviceGetMigDeviceHandleByIndex",
            "nvmlDeviceGetGpuInstanceId",
            "nvmlDeviceGetComputeInstanceId",
            "nvmlDeviceGetGpuInstanceById",
            "nvmlGpuInstanceGetInfo",
            "nvmlDeviceGetGpuInstanceProfileInfo",
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            "nvmlGpuInstanceCreateComputeInstance",
            "nvmlGpuInstanceDestroy",
            "nvmlGpuInstanceGetComputeInstanceById",
            "nvmlComputeInstanceDestroy",
            "nvmlEventSetCreate",
            "nvmlDeviceGetSupportedEventTypes",
            "nvmlDeviceRegisterEvents",
            "nvmlEventSetWait_v2",
            "nvmlEventSetFree",
        }
    )

    def __init__(self) -> None:
        self.initialised = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}  # function name -> NVML error code, raised once
        self.lost: set[str] = set()
        self.pending: list[SimpleNamespace] = []
        self.wait_lost = False
        self.registered: dict[str, int] = {}
        self.freed = False
        xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
        self.h100 = Dev(
            H100_UUID,
            "NVIDIA H100 80GB HBM3",
            81559,
            used_mib=4_600,
            reasons=pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap,
            events_supported=xid | dbe | pynvml.nvmlEventTypeSingleBitEccError,
            procs=[
                SimpleNamespace(pid=101, usedGpuMemory=3_000 * MIB),
                SimpleNamespace(pid=101, usedGpuMemory=100 * MIB),
                SimpleNamespace(pid=202, usedGpuMemory=1_000 * MIB),
                SimpleNamespace(pid=303, usedGpuMemory=None),
            ],
        )
        self.a100 = Dev(
            A100_UUID,
            "NVIDIA A100-SXM4-80GB",
            81920,
            mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
            temp=63,
            power_mw=287_000,
            sm_clock=1410,
            events_supported=xid,
        )
        self.gpus = [self.h100, self.a100]
        self.instances: dict[tuple[str, int], GpuInstance] = {}
        self._make_instance(self.a100, 14, start=0, gi_id=3)
        self._make_instance(self.a100, 9, start=4, gi_id=2)
        self.mig(2).procs = [SimpleNamespace(pid=404, usedGpuMemory=2_048 * MIB)]
        self.mig(2).used_mib = 2_100

    # -- helpers for tests -------------------------------------------------------------------

    def mig(self, gi_id: int) -> Dev:
        return self.instances[(A100_UUID, gi_id)].cis[0].mig

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for called, args in self.calls if called == name]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in vars(pynvml).items():
            if name.startswith("nvml") and isinstance(value, types.FunctionType):
                if name in self.FUNCTIONS:
                    monkeypatch.setattr(pynvml, name, self._recorded(name, getattr(self, name)))
                elif name != "nvmlErrorString":  # NVMLError.__str__ uses it
                    monkeypatch.setattr(pynvml, name, self._trap(name))

    def _recorded(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            code = self.fail.pop(name, None)
            if code is not None:
                raise nvml_error(code)
            return method(*args)

        return call

    @staticmethod
    def _trap(name: str) -> Callable[..., Any]:
        def trap(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"NvmlBackend called pynvml.{name}, which the fake lacks")

        return trap

    def _live(self, dev: Dev) -> Dev:
        board = dev.parent or dev
        if board.uuid in self.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return dev

    @staticmethod
    def _board_only(dev: Dev) -> Dev:
        if dev.parent is not None:  # NVML answers these for whole GPUs only
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _migs(self, parent: Dev) -> list[Dev]:
        instances = sorted(
            (gi for (uuid, _), gi in self.instances.items() if uuid == parent.uuid),
            key=lambda gi: gi.id,
        )
        return [ci.mig for gi in instances for ci in gi.cis.values()]

    def _make_instance(self, parent: Dev, profile_id: int, start: int, gi_id: int) -> GpuInstance:
        gi = GpuInstance(parent, gi_id, profile_id, start, A100_BY_ID[profile_id][3])
        self.instances[(parent.uuid, gi_id)] = gi
        self._add_compute_instance(gi)
        return gi

    def _add_compute_instance(self, gi: GpuInstance) -> ComputeInstance:
        mig = Dev(
            f"MIG-{gi.parent.uuid[4:12]}-gi{gi.id}",
            memory_mib=A100_BY_ID[gi.profile_id][4],
            used_mib=13,
            mig_mode=None,
            parent=gi.parent,
            gi_id=gi.id,
        )
        ci = ComputeInstance(0, mig)
        gi.cis[0] = ci
        return ci

    # -- the pynvml surface ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Dev:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Dev:
        for dev in self.gpus + [m for g in self.gpus for m in self._migs(g)]:
            if dev.uuid == uuid:
                return dev
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, dev: Dev) -> str:
        return self._live(dev).uuid

    def nvmlDeviceGetName(self, dev: Dev) -> str:
        return self._live(dev).name

    def nvmlDeviceGetMemoryInfo(self, dev: Dev) -> SimpleNamespace:
        self._live(dev)
        total, used = dev.memory_mib * MIB, dev.used_mib * MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetMigMode(self, dev: Dev) -> list[int]:
        mode = self._live(dev).mig_mode
        if mode is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, dev: Dev) -> int:
        return 7 if self._live(dev).mig_mode is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, dev: Dev, index: int) -> Dev:
        migs = self._migs(self._live(dev))
        if index >= len(migs):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return migs[index]

    def nvmlDeviceGetGpuInstanceId(self, mig: Dev) -> int:
        return self._live(mig).gi_id

    def nvmlDeviceGetComputeInstanceId(self, mig: Dev) -> int:
        return self._live(mig).ci_id

    def nvmlDeviceGetGpuInstanceById(self, dev: Dev, gi_id: int) -> GpuInstance:
        try:
            return self.instances[(self._live(dev).uuid, gi_id)]
        except KeyError:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND) from None

    def nvmlGpuInstanceGetInfo(self, gi: GpuInstance) -> SimpleNamespace:
        placement = SimpleNamespace(start=gi.start, size=gi.size)
        return SimpleNamespace(device=gi.parent, id=gi.id, profileId=gi.profile_id, placement=placement)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, dev: Dev, enum: int) -> SimpleNamespace:
        self._live(dev)
        if enum > pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if enum not in A100_PROFILES:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile_id, name, slices, _size, memory = A100_PROFILES[enum]
        return SimpleNamespace(id=profile_id, name=name, sliceCount=slices, memorySizeMB=memory)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: Dev) -> Dev:
        assert mig.parent is not None
        return mig.parent

    def nvmlDeviceGetTemperature(self, dev: Dev, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._board_only(self._live(dev)).temp

    def nvmlDeviceGetUtilizationRates(self, dev: Dev) -> SimpleNamespace:
        self._board_only(self._live(dev))
        if dev.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=dev.util, memory=20)

    def nvmlDeviceGetPowerUsage(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).power_mw

    def nvmlDeviceGetClockInfo(self, dev: Dev, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._board_only(self._live(dev)).sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, dev: Dev) -> int:
        return self._board_only(self._live(dev)).reasons

    def nvmlDeviceGetComputeRunningProcesses(self, dev: Dev) -> list[SimpleNamespace]:
        return self._live(dev).procs

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, dev: Dev, profile_id: int, placement_ref: Any
    ) -> GpuInstance:
        placement = placement_ref._obj  # ctypes.byref(c_nvmlGpuInstancePlacement_t)
        assert isinstance(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        if A100_BY_ID[profile_id][3] != placement.size:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        wanted = set(range(placement.start, placement.start + placement.size))
        for (uuid, _), gi in self.instances.items():
            if uuid == dev.uuid and wanted & set(range(gi.start, gi.start + gi.size)):
                raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = max((i for (u, i) in self.instances if u == dev.uuid), default=0) + 1
        gi = GpuInstance(dev, gi_id, profile_id, placement.start, placement.size)
        self.instances[(dev.uuid, gi_id)] = gi
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: GpuInstance, profile: int, engine: int
    ) -> SimpleNamespace:
        assert engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return SimpleNamespace(id=profile + 100)  # a distinct id, to see it passed on

    def nvmlGpuInstanceCreateComputeInstance(self, gi: GpuInstance, profile_id: int) -> ComputeInstance:
        return self._add_compute_instance(gi)

    def nvmlGpuInstanceDestroy(self, gi: GpuInstance) -> None:
        if gi.cis:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        del self.instances[(gi.parent.uuid, gi.id)]

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: GpuInstance, ci_id: int) -> ComputeInstance:
        return gi.cis[ci_id]

    def nvmlComputeInstanceDestroy(self, ci: ComputeInstance) -> None:
        if ci.mig.procs:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        gi = self.instances[(A100_UUID, ci.mig.gi_id)]
        del gi.cis[ci.id]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, dev: Dev) -> int:
        return self._live(dev).events_supported

    def nvmlDeviceRegisterEvents(self, dev: Dev, types_: int, event_set: str) -> None:
        assert event_set == "event-set"
        self.registered[dev.uuid] = types_

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert (event_set, timeout_ms) == ("event-set", 0)
        if self.wait_lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if not self.pending:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return self.pending.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    return nvml


@pytest.fixture
def backend(fake: FakeNvml) -> Iterator[NvmlBackend]:
    instance = NvmlBackend()
    yield instance
    instance.close()


def event(dev: Dev, kind: int, data: int = 0, gi: int = NO_INSTANCE) -> SimpleNamespace:
    return SimpleNamespace(device=dev, eventType=kind, eventData=data, gpuInstanceId=gi, computeInstanceId=gi)


# -- the fake itself -------------------------------------------------------------------------


def test_fake_covers_exactly_the_calls_nvml_makes() -> None:
    source = Path(nvml_module.__file__).read_text()
    names = set(re.findall(r"pynvml\.(nvml\w+)", source)) | set(re.findall(r'"(nvml\w+)"', source))
    functions = {n for n in names if isinstance(getattr(pynvml, n), types.FunctionType)}
    assert functions == FakeNvml.FUNCTIONS


# -- lifecycle -------------------------------------------------------------------------------


def test_init_registers_health_events_and_close_releases(fake: FakeNvml) -> None:
    backend = NvmlBackend()
    assert (backend.name, backend.simulated) == ("nvml", False)
    assert fake.initialised == 1
    xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
    assert fake.registered == {H100_UUID: xid | dbe, A100_UUID: xid}
    backend.close()
    backend.close()
    assert fake.initialised == 0 and fake.freed


def test_init_failures(fake: FakeNvml) -> None:
    fake.fail["nvmlInit"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(GpuBackendError, match="NVML did not initialise: Driver Not Loaded"):
        NvmlBackend()
    fake.fail["nvmlDeviceGetCount"] = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(GpuBackendError, match="create NVML event set"):
        NvmlBackend()
    assert fake.initialised == 0  # shut down again after the failed start


def test_unsupported_event_registration_is_skipped(fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    backend = NvmlBackend()
    assert list(fake.registered) == [A100_UUID]
    backend.close()


def test_nvml_available(fake: FakeNvml) -> None:
    assert nvml_available() is True
    assert fake.initialised == 0
    fake.fail["nvmlInit"] = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert nvml_available() is False
    fake.gpus = []
    assert nvml_available() is False
    assert fake.initialised == 0


def test_make_backend_picks_nvml(fake: FakeNvml) -> None:
    for kind in ("nvml", "auto"):
        backend = make_backend(kind, "host-a", "H100-80GB")
        assert isinstance(backend, NvmlBackend)
        backend.close()
    fake.gpus = []
    assert make_backend("auto", "host-a", "H100-80GB").simulated


# -- inventory -------------------------------------------------------------------------------


def test_inventory(backend: NvmlBackend) -> None:
    h100, a100 = backend.list_gpus()
    assert (h100.uuid, h100.index, h100.name) == (H100_UUID, 0, "NVIDIA H100 80GB HBM3")
    assert (h100.model, h100.memory_mib, h100.mig_enabled, h100.mig_devices) == (
        "H100-80GB",
        81559,
        False,
        (),
    )
    assert (a100.model, a100.mig_enabled, a100.simulated) == ("A100-80GB", True, False)
    small, big = a100.mig_devices
    assert (small.profile, small.start, small.memory_slices, small.gpu_instance_id) == (
        "2g.20gb",
        0,
        2,
        3,
    )
    assert (big.profile, big.start, big.memory_slices, big.gpu_instance_id) == ("3g.40gb", 4, 4, 2)
    assert (big.memory_mib, big.compute_instance_id, big.parent_uuid) == (40192, 0, A100_UUID)
    assert big.uuid.startswith("MIG-")
    assert backend.mig_layout(A100_UUID) == [small, big]
    assert backend.mig_layout(H100_UUID) == []


def test_gpu_without_mig_support(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.h100.mig_mode = None
    assert backend.list_gpus()[0].mig_enabled is False
    assert backend.mig_layout(H100_UUID) == []
    with pytest.raises(GpuBackendError, match="MIG mode is disabled"):
        backend.create_mig(H100_UUID, "1g.10gb", 0)


def test_unknown_uuid_is_a_backend_error(backend: NvmlBackend) -> None:
    with pytest.raises(GpuBackendError, match="sample on GPU-nope: Not Found"):
        backend.sample("GPU-nope")


# -- samples ---------------------------------------------------------------------------------


def test_sample_whole_gpu(backend: NvmlBackend) -> None:
    sample = backend.sample(H100_UUID)
    assert sample.uuid == H100_UUID and sample.t_ms > 1_600_000_000_000
    assert (sample.temp_c, sample.util_pct, sample.power_w, sample.sm_clock_mhz) == (
        41.0,
        55.0,
        312.5,
        1755,
    )
    assert (sample.mem_used_mib, sample.mem_total_mib) == (4_600, 81559)
    assert sample.throttle == ("sw_power_cap", "sw_thermal")
    assert sample.mem_by_owner == {"pid:101": 3_100, "pid:202": 1_000}


def test_sample_mig_device_reads_board_from_parent(fake: FakeNvml, backend: NvmlBackend) -> None:
    sample = backend.sample(fake.mig(2).uuid)
    assert (sample.temp_c, sample.power_w, sample.sm_clock_mhz) == (63.0, 287.0, 1410)
    assert (sample.mem_used_mib, sample.mem_total_mib) == (2_100, 40192)
    assert sample.util_pct == 0.0  # NVML has none for MIG devices
    assert sample.mem_by_owner == {"pid:404": 2_048}
    assert backend.sample(A100_UUID).util_pct == 0.0


def test_unsupported_readings_default(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NO_PERMISSION
    sample = backend.sample(H100_UUID)
    assert (sample.power_w, sample.mem_by_owner) == (0.0, {})


def test_throttle_decoding() -> None:
    bits = (
        pynvml.nvmlClocksEventReasonGpuIdle
        | pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    )
    assert decode_clock_reasons(bits) == ("gpu_idle", "hw_slowdown", "hw_thermal", "hw_power_brake")
    assert decode_clock_reasons(0) == ()


def test_throttle_falls_back_to_the_older_call(
    fake: FakeNvml, backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.fail["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert backend.sample(H100_UUID).throttle == ("sw_power_cap", "sw_thermal")
    assert len(fake.called("nvmlDeviceGetCurrentClocksThrottleReasons")) == 1
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    assert backend.sample(H100_UUID).throttle == ("sw_power_cap", "sw_thermal")
    assert len(fake.called("nvmlDeviceGetCurrentClocksThrottleReasons")) == 2


# -- MIG changes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "start", "profile_id", "size", "ci_enum"),
    [
        ("1g.10gb", 2, 19, 1, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
        ("1g.20gb", 2, 15, 2, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
        ("2g.20gb", 2, 14, 2, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE),
    ],
)
def test_create_mig(
    fake: FakeNvml,
    backend: NvmlBackend,
    profile: str,
    start: int,
    profile_id: int,
    size: int,
    ci_enum: int,
) -> None:
    mig = backend.create_mig(A100_UUID, profile, start)
    ((dev, called_id, placement_ref),) = fake.called("nvmlDeviceCreateGpuInstanceWithPlacement")
    assert (dev, called_id) == (fake.a100, profile_id)
    assert (placement_ref._obj.start, placement_ref._obj.size) == (start, size)
    ((_, called_enum, _),) = fake.called("nvmlGpuInstanceGetComputeInstanceProfileInfo")
    assert called_enum == ci_enum
    ((_, ci_profile),) = fake.called("nvmlGpuInstanceCreateComputeInstance")
    assert ci_profile == ci_enum + 100
    assert (mig.profile, mig.start, mig.memory_slices, mig.parent_uuid) == (
        profile,
        start,
        size,
        A100_UUID,
    )
    assert mig in backend.mig_layout(A100_UUID)


@pytest.mark.parametrize(
    ("profile", "start", "message"),
    [
        ("3g.40gb", 2, r"3g\.40gb cannot start at memory slice 2 on A100-80GB; legal: 0, 4"),
        ("1g.10gb", 7, "cannot start at memory slice 7"),
        ("1g.10gb", 5, r"1g\.10gb@5 overlaps 3g\.40gb@4"),
        ("7g.80gb", 0, r"overlaps 2g\.20gb@0, 3g\.40gb@4"),
        ("5g.50gb", 0, r"no MIG profile '5g\.50gb' \(known: 1g\.10gb, 1g\.10gb\+me"),
        ("1g.10gb+me", 0, r"1g\.10gb\+me@0 overlaps 2g\.20gb@0"),
    ],
)
def test_create_mig_refused_before_nvml_changes_anything(
    fake: FakeNvml, backend: NvmlBackend, profile: str, start: int, message: str
) -> None:
    with pytest.raises(GpuBackendError, match=message):
        backend.create_mig(A100_UUID, profile, start)
    assert fake.called("nvmlDeviceCreateGpuInstanceWithPlacement") == []


def test_create_mig_on_a_gpu_without_mig(backend: NvmlBackend) -> None:
    with pytest.raises(GpuBackendError, match=f"MIG mode is disabled on {H100_UUID}"):
        backend.create_mig(H100_UUID, "1g.10gb", 0)


def test_failed_compute_instance_rolls_back_the_gpu_instance(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.fail["nvmlGpuInstanceCreateComputeInstance"] = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(GpuBackendError, match=f"create MIG 1g.10gb@2 on {A100_UUID}"):
        backend.create_mig(A100_UUID, "1g.10gb", 2)
    assert len(fake.called("nvmlGpuInstanceDestroy")) == 1
    assert sorted(gi.start for gi in fake.instances.values()) == [0, 4]


def test_nvml_refusal_is_mapped(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.fail["nvmlDeviceCreateGpuInstanceWithPlacement"] = pynvml.NVML_ERROR_NO_PERMISSION
    with pytest.raises(GpuBackendError, match="Insufficient Permissions") as caught:
        backend.create_mig(A100_UUID, "1g.10gb", 2)
    assert isinstance(caught.value.__cause__, pynvml.NVMLError_NoPermission)


def test_destroy_mig(fake: FakeNvml, backend: NvmlBackend) -> None:
    small = fake.mig(3).uuid
    backend.destroy_mig(A100_UUID, small)
    destroyed = [n for n, _ in fake.calls if n.endswith("InstanceDestroy")]
    assert destroyed == ["nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy"]
    assert [m.profile for m in backend.mig_layout(A100_UUID)] == ["3g.40gb"]
    with pytest.raises(GpuBackendError, match="is not a MIG device of"):
        backend.destroy_mig(A100_UUID, small)
    with pytest.raises(GpuBackendError, match=r"destroy MIG .* on GPU-2"):
        backend.destroy_mig(A100_UUID, fake.mig(2).uuid)  # pid 404 still runs there
    assert len(backend.mig_layout(A100_UUID)) == 1


# -- health ----------------------------------------------------------------------------------


def test_health_events_from_the_event_set(fake: FakeNvml, backend: NvmlBackend) -> None:
    backend.list_gpus()  # learns which MIG device each GPU instance is
    xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
    fake.pending = [event(fake.h100, xid, 79), event(fake.h100, dbe), event(fake.a100, xid, 31, 2)]
    events = backend.health_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [
        (H100_UUID, "xid", 79),
        (H100_UUID, "ecc_dbe", None),
        (fake.mig(2).uuid, "xid", 31),
    ]
    assert events[0].detail == "XID 79"
    assert backend.health_events() == []


def test_event_wait_error_is_mapped(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.fail["nvmlEventSetWait_v2"] = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(GpuBackendError, match="read NVML events"):
        backend.health_events()


def test_gpu_lost_on_any_call(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.lost.add(H100_UUID)
    for _ in range(2):
        with pytest.raises(GpuBackendError, match=f"sample: {H100_UUID} is lost"):
            backend.sample(H100_UUID)
    assert [(e.uuid, e.kind) for e in backend.health_events()] == [(H100_UUID, "gpu_lost")]
    assert [g.uuid for g in backend.list_gpus()] == [A100_UUID]
    assert backend.health_events() == []


def test_lost_mig_device_reports_its_gpu(fake: FakeNvml, backend: NvmlBackend) -> None:
    backend.list_gpus()
    fake.lost.add(A100_UUID)
    with pytest.raises(GpuBackendError, match="is lost"):
        backend.sample(fake.mig(2).uuid)
    assert [(e.uuid, e.kind) for e in backend.health_events()] == [(A100_UUID, "gpu_lost")]


def test_gpu_lost_seen_by_the_event_set(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.lost.add(A100_UUID)
    fake.wait_lost = True
    assert [(e.uuid, e.kind) for e in backend.health_events()] == [(A100_UUID, "gpu_lost")]


def test_load_hints_are_ignored(fake: FakeNvml, backend: NvmlBackend) -> None:
    before = len(fake.calls)
    backend.note_load("alloc-1", [H100_UUID], 1000, 50.0)
    backend.forget_load("alloc-1")
    assert len(fake.calls) == before


def test_event_from_a_gpu_lost_meanwhile(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.pending = [event(fake.a100, pynvml.nvmlEventTypeXidCriticalError, 79)]
    fake.lost.add(A100_UUID)
    assert [(e.uuid, e.kind) for e in backend.health_events()] == [(A100_UUID, "gpu_lost")]


def test_gpu_lost_before_the_backend_starts(fake: FakeNvml) -> None:
    fake.lost.add(H100_UUID)
    backend = NvmlBackend()  # the other GPU still works
    assert list(fake.registered) == [A100_UUID]
    assert [g.uuid for g in backend.list_gpus()] == [A100_UUID]
    backend.close()
