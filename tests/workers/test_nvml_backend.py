"""NvmlBackend against the pynvml fake in nvml_fake.py.

The fake holds two GPUs: an H100 with MIG disabled and an A100-80GB in MIG mode with a
2g.20gb@0 and a 3g.40gb@4 instance. The ``h100_mig`` fixture turns the H100 into what a busy
H100 80GB HBM3 in MIG mode reports (instances, ids, clocks, throttle reasons, ECC counts).
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from tests.workers.nvml_fake import A100_UUID, H100_UUID, MIB, FakeNvml, event
from workers.gpu import make_backend
from workers.gpu import nvml as nvml_module
from workers.gpu.base import GpuBackendError
from workers.gpu.nvml import NvmlBackend, decode_clock_reasons, nvml_available


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
    fake.pending = [event(fake.h100, xid, 13), event(fake.h100, dbe), event(fake.a100, xid, 31, 2)]
    events = backend.health_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [
        (H100_UUID, "xid", 13),
        (H100_UUID, "ecc_dbe", None),
        (fake.mig(2).uuid, "xid", 31),
    ]
    assert events[0].detail == "XID 13"
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


# -- an H100 80GB HBM3 in MIG mode, busy ----------------------------------------------------

# (profile id, start, GPU instance id) as NVML numbers them on an H100 for this layout:
# ids by placement, full GPU 0, halves 1-2, quarters 3-6, eighths 7-13.
H100_LAYOUT = ((9, 4, 2), (14, 0, 3), (19, 2, 9), (19, 3, 10))
CORRECTED, UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
GPU_UNAVAILABLE = pynvml.nvmlEventTypeGpuUnavailableError


@pytest.fixture
def h100_mig(fake: FakeNvml) -> Iterator[NvmlBackend]:
    h100 = fake.h100
    h100.mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    h100.procs = []
    h100.used_mib = 26_412
    h100.temp, h100.power_mw, h100.sm_clock = 71, 689_450, 1_590
    h100.reasons = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwSlowdown
    h100.ecc = {CORRECTED: 12, UNCORRECTED: 1}
    h100.events_supported |= GPU_UNAVAILABLE
    for profile_id, start, gi_id in H100_LAYOUT:
        fake._make_instance(h100, profile_id, start, gi_id)
    fake.mig(2, H100_UUID).procs = [SimpleNamespace(pid=5150, usedGpuMemory=24_576 * MIB)]
    fake.mig(2, H100_UUID).used_mib = 24_600
    backend = NvmlBackend()
    yield backend
    backend.close()


def test_h100_mig_inventory(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    h100 = h100_mig.list_gpus()[0]
    assert (h100.model, h100.mig_enabled) == ("H100-80GB", True)
    got = [
        (m.profile, m.start, m.memory_slices, m.memory_mib, m.gpu_instance_id, m.compute_instance_id)
        for m in h100.mig_devices
    ]
    assert got == [
        ("2g.20gb", 0, 2, 19968, 3, 0),
        ("1g.10gb", 2, 1, 9856, 9, 0),
        ("1g.10gb", 3, 1, 9856, 10, 0),
        ("3g.40gb", 4, 4, 40192, 2, 0),
    ]
    assert [m.uuid for m in h100.mig_devices] == [fake.mig(g, H100_UUID).uuid for g in (3, 9, 10, 2)]
    assert fake.registered[H100_UUID] & GPU_UNAVAILABLE


def test_h100_sample_throttle_ecc_and_processes(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    board = h100_mig.sample(H100_UUID)
    assert (board.temp_c, board.power_w, board.sm_clock_mhz, board.util_pct) == (71.0, 689.45, 1590, 0.0)
    assert board.throttle == ("sw_power_cap", "hw_slowdown")
    assert (board.ecc_corrected, board.ecc_uncorrected) == (12, 1)
    assert (board.mem_used_mib, board.mem_total_mib) == (26_412, 81559)
    big = h100_mig.sample(fake.mig(2, H100_UUID).uuid)
    assert (big.ecc_corrected, big.ecc_uncorrected) == (12, 1)  # the board's counts
    assert big.mem_by_owner == {"pid:5150": 24_576}
    assert (big.mem_used_mib, big.mem_total_mib) == (24_600, 40192)
    counters = {args[1:] for args in fake.called("nvmlDeviceGetTotalEccErrors")}
    assert counters == {(CORRECTED, pynvml.NVML_VOLATILE_ECC), (UNCORRECTED, pynvml.NVML_VOLATILE_ECC)}


def test_ecc_counts_default_to_zero_when_unavailable(fake: FakeNvml, backend: NvmlBackend) -> None:
    sample = backend.sample(A100_UUID)  # the fake's A100 reports no ECC: NOT_SUPPORTED
    assert (sample.ecc_corrected, sample.ecc_uncorrected) == (0, 0)
    fake.h100.ecc = {CORRECTED: 3, UNCORRECTED: 0}
    fake.fail["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_NO_PERMISSION
    assert backend.sample(H100_UUID).ecc_corrected == 0
    assert backend.sample(H100_UUID).ecc_corrected == 3


def test_h100_create_and_destroy(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    small = fake.mig(9, H100_UUID).uuid
    h100_mig.destroy_mig(H100_UUID, small)
    h100_mig.destroy_mig(H100_UUID, fake.mig(10, H100_UUID).uuid)
    made = h100_mig.create_mig(H100_UUID, "1g.20gb", 2)
    ((dev, profile_id, placement),) = fake.called("nvmlDeviceCreateGpuInstanceWithPlacement")
    assert (dev, profile_id, placement._obj.start, placement._obj.size) == (fake.h100, 15, 2, 2)
    assert (made.profile, made.start, made.memory_mib, made.parent_uuid) == ("1g.20gb", 2, 19968, H100_UUID)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb@4 overlaps 3g\.40gb@4"):
        h100_mig.create_mig(H100_UUID, "1g.10gb", 4)


def test_xid_79_means_the_gpu_fell_off_the_bus(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    h100_mig.list_gpus()
    xid = pynvml.nvmlEventTypeXidCriticalError
    fake.pending = [event(fake.h100, xid, 79), event(fake.h100, xid, 79), event(fake.h100, xid, 43, 9)]
    events = h100_mig.health_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [
        (H100_UUID, "xid", 79),
        (H100_UUID, "gpu_lost", None),  # once, however many XIDs say so
        (H100_UUID, "xid", 79),
        (fake.mig(9, H100_UUID).uuid, "xid", 43),  # an error inside one instance names it
    ]


def test_gpu_unavailable_event_reports_the_loss_once(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    fake.pending = [event(fake.h100, GPU_UNAVAILABLE), event(fake.h100, GPU_UNAVAILABLE)]
    assert [(e.uuid, e.kind) for e in h100_mig.health_events()] == [(H100_UUID, "gpu_lost")]
    fake.lost.add(H100_UUID)
    with pytest.raises(GpuBackendError, match="is lost"):
        h100_mig.sample(H100_UUID)
    assert h100_mig.health_events() == []  # already reported
