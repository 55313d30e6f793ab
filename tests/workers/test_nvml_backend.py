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
from workers.gpu import gpm as gpm_module
from workers.gpu import make_backend
from workers.gpu import nvml as nvml_module
from workers.gpu import nvml_board as nvml_board_module
from workers.gpu import nvml_topology as nvml_topology_module
from workers.gpu import process_util as process_util_module
from workers.gpu.base import GpuBackendError, GpuLost
from workers.gpu.nvml import NvmlBackend, decode_clock_reasons, nvml_available

# -- the fake itself -------------------------------------------------------------------------


def test_fake_covers_exactly_the_calls_nvml_makes() -> None:
    source = Path(nvml_module.__file__).read_text() + Path(gpm_module.__file__).read_text()
    source += Path(process_util_module.__file__).read_text()
    source += Path(nvml_board_module.__file__).read_text()
    source += Path(nvml_topology_module.__file__).read_text()
    names = set(re.findall(r"pynvml\.(nvml\w+)", source)) | set(re.findall(r'"(nvml\w+)"', source))
    functions = {n for n in names if isinstance(getattr(pynvml, n), types.FunctionType)}
    assert functions == FakeNvml.FUNCTIONS


# -- lifecycle -------------------------------------------------------------------------------


def test_init_registers_fault_events_and_close_releases(fake: FakeNvml) -> None:
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
    assert make_backend("auto", "host-a", "H100-80GB", driver_paths=()).simulated


def test_auto_never_simulates_on_a_host_with_the_nvidia_driver(fake: FakeNvml, tmp_path: Path) -> None:
    """Guards review §1.6: NVML failing on a GPU host (driver/library mismatch) silently gave
    simulated H100s; now the agent stops with the cause and the driver file it found."""
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n")
    fake.fail["nvmlInit"] = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    with pytest.raises(
        GpuBackendError, match=rf"NVML did not initialise: .*{version} exists.*GPU_BACKEND=simulated"
    ):
        make_backend("auto", "host-a", "H100-80GB", driver_paths=(version, tmp_path / "nvidiactl"))
    fake.fail["nvmlInit"] = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    backend = make_backend("auto", "host-a", "H100-80GB", driver_paths=(tmp_path / "nvidiactl",))
    assert backend.simulated  # no driver here: a laptop or CI, simulation is what auto means


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
    """Guards review §1.3: NVML has no utilization for a MIG device nor for a GPU in MIG mode,
    and the A100 has no GPM, so it is None (unmeasured); the old code said 0.0 (idle)."""
    for _ in range(2):  # a second sample has a previous one, and still no GPM to measure
        sample = backend.sample(fake.mig(2).uuid)
        assert (sample.temp_c, sample.power_w, sample.sm_clock_mhz) == (63.0, 287.0, 1410)
        assert (sample.mem_used_mib, sample.mem_total_mib) == (2_100, 40192)
        assert sample.util_pct is None
        assert sample.mem_by_owner == {"pid:404": 2_048}
        assert backend.sample(A100_UUID).util_pct is None
    assert fake.called("nvmlGpmSampleAlloc") == []


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


# -- faults ----------------------------------------------------------------------------------


def test_fault_events_from_the_event_set(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §0 #2: application XIDs (13, 31: the tenant's own kernel) are
    ``app_xid``, not ``xid``, so the control side does not drain the GPU for them."""
    backend.list_gpus()  # learns which MIG device each GPU instance is
    xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
    fake.pending = [
        event(fake.h100, xid, 13),
        event(fake.h100, dbe),
        event(fake.a100, xid, 31, 2),
        event(fake.a100, xid, 48),
    ]
    events = backend.fault_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [
        (H100_UUID, "app_xid", 13),
        (H100_UUID, "ecc_dbe", None),
        (fake.mig(2).uuid, "app_xid", 31),
        (A100_UUID, "xid", 48),
    ]
    assert events[0].detail.startswith("XID 13: graphics engine exception")
    assert events[3].detail == "XID 48: double-bit ECC error; the GPU needs a reset"
    assert backend.fault_events() == []


def test_event_wait_error_is_mapped(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.fail["nvmlEventSetWait_v2"] = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(GpuBackendError, match="read NVML events"):
        backend.fault_events()


def test_gpu_lost_on_any_call(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.lost.add(H100_UUID)
    for _ in range(2):
        with pytest.raises(GpuBackendError, match=f"sample: {H100_UUID} is lost"):
            backend.sample(H100_UUID)
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(H100_UUID, "gpu_lost")]
    assert [g.uuid for g in backend.list_gpus()] == [A100_UUID]
    assert backend.fault_events() == []


def test_lost_mig_device_reports_its_gpu(fake: FakeNvml, backend: NvmlBackend) -> None:
    backend.list_gpus()
    fake.lost.add(A100_UUID)
    with pytest.raises(GpuBackendError, match="is lost"):
        backend.sample(fake.mig(2).uuid)
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(A100_UUID, "gpu_lost")]


def test_gpu_lost_seen_by_the_event_set(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.lost.add(A100_UUID)
    fake.wait_lost = True
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(A100_UUID, "gpu_lost")]


def test_load_hints_are_ignored(fake: FakeNvml, backend: NvmlBackend) -> None:
    before = len(fake.calls)
    backend.note_load("alloc-1", [H100_UUID], 1000, 50.0)
    backend.forget_load("alloc-1")
    assert len(fake.calls) == before


def test_event_from_a_gpu_lost_meanwhile(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.pending = [event(fake.a100, pynvml.nvmlEventTypeXidCriticalError, 79)]
    fake.lost.add(A100_UUID)
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(A100_UUID, "gpu_lost")]


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
    assert got == [  # memory as NVML's profile info states it (memorySizeMB)
        ("2g.20gb", 0, 2, 20096, 3, 0),
        ("1g.10gb", 2, 1, 9984, 9, 0),
        ("1g.10gb", 3, 1, 9984, 10, 0),
        ("3g.40gb", 4, 4, 40448, 2, 0),
    ]
    assert [m.uuid for m in h100.mig_devices] == [fake.mig(g, H100_UUID).uuid for g in (3, 9, 10, 2)]
    assert fake.registered[H100_UUID] & GPU_UNAVAILABLE


def test_h100_sample_throttle_ecc_and_processes(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    board = h100_mig.sample(H100_UUID)
    # A GPU in MIG mode: NVML has no utilization; GPM has, from the second sample on.
    assert (board.temp_c, board.power_w, board.sm_clock_mhz, board.util_pct) == (71.0, 689.45, 1590, None)
    assert board.throttle == ("sw_power_cap", "hw_slowdown")
    assert (board.ecc_corrected, board.ecc_uncorrected) == (12, 1)
    assert (board.mem_used_mib, board.mem_total_mib) == (26_412, 81559)
    big = h100_mig.sample(fake.mig(2, H100_UUID).uuid)
    assert (big.ecc_corrected, big.ecc_uncorrected) == (12, 1)  # the board's counts
    assert big.mem_by_owner == {"pid:5150": 24_576}
    assert (big.mem_used_mib, big.mem_total_mib) == (24_600, 40448)
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
    assert (made.profile, made.start, made.memory_mib, made.parent_uuid) == ("1g.20gb", 2, 20096, H100_UUID)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb@4 overlaps 3g\.40gb@4"):
        h100_mig.create_mig(H100_UUID, "1g.10gb", 4)


def test_xid_79_means_the_gpu_fell_off_the_bus(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    h100_mig.list_gpus()
    xid = pynvml.nvmlEventTypeXidCriticalError
    fake.pending = [event(fake.h100, xid, 79), event(fake.h100, xid, 79), event(fake.h100, xid, 43, 9)]
    events = h100_mig.fault_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [
        (H100_UUID, "xid", 79),
        (H100_UUID, "gpu_lost", None),  # once, however many XIDs say so
        (H100_UUID, "xid", 79),
        (fake.mig(9, H100_UUID).uuid, "app_xid", 43),  # an error inside one instance names it
    ]


def test_gpu_unavailable_event_reports_the_loss_once(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    fake.pending = [event(fake.h100, GPU_UNAVAILABLE), event(fake.h100, GPU_UNAVAILABLE)]
    assert [(e.uuid, e.kind) for e in h100_mig.fault_events()] == [(H100_UUID, "gpu_lost")]
    fake.lost.add(H100_UUID)
    with pytest.raises(GpuBackendError, match="is lost"):
        h100_mig.sample(H100_UUID)
    assert h100_mig.fault_events() == []  # already reported


# -- review findings (issue 18) ---------------------------------------------------------------


def test_sample_of_a_lost_gpu_raises_gpu_lost_naming_it(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §0 #7: the agent must tell a lost GPU from other failures, per GPU, and
    drop it; GpuLost names the board (a MIG device's parent), and gpu_lost is queued once."""
    backend.list_gpus()
    fake.lost.add(A100_UUID)
    for device in (A100_UUID, fake.mig(2).uuid):
        with pytest.raises(GpuLost, match="is lost") as caught:
            backend.sample(device)
        assert caught.value.uuid == A100_UUID
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(A100_UUID, "gpu_lost")]
    backend.sample(H100_UUID)  # the other GPU still samples
    fake.fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_RESET_REQUIRED
    with pytest.raises(GpuLost):
        backend.sample(H100_UUID)
    with pytest.raises(GpuBackendError) as other:
        backend.sample("GPU-nope")
    assert not isinstance(other.value, GpuLost)


def test_h100_mig_utilization_from_gpm(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    """Guards review §1.3: on an H100 in MIG mode utilization comes from GPM samples, each
    read against the previous one (the first has none: None), never NVML's missing 0."""
    big = fake.mig(2, H100_UUID)
    big.util, fake.h100.util = 73, 41
    assert h100_mig.sample(big.uuid).util_pct is None
    assert h100_mig.sample(H100_UUID).util_pct is None
    assert h100_mig.sample(big.uuid).util_pct == 73.0
    assert h100_mig.sample(H100_UUID).util_pct == 41.0
    big.util = 0  # measured idle is 0, and says so
    assert h100_mig.sample(big.uuid).util_pct == 0.0
    ((parent, gi_id, _),) = {(a[0], a[1], None) for a in fake.called("nvmlGpmMigSampleGet")}
    assert (parent, gi_id) == (fake.h100, 2)
    assert len(fake.gpm_samples) == 2  # one kept per device; the others were freed
    assert {args[0] for args in fake.called("nvmlDeviceGetUtilizationRates")} == {fake.h100}  # never a MIG
    h100_mig.close()
    assert fake.gpm_samples == {}


def test_a_gpm_failure_leaves_utilization_unmeasured_not_the_sample(
    fake: FakeNvml, h100_mig: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    big = fake.mig(2, H100_UUID).uuid
    h100_mig.sample(big)
    fake.fail["nvmlGpmMetricsGet"] = pynvml.NVML_ERROR_UNKNOWN
    sample = h100_mig.sample(big)
    assert (sample.util_pct, sample.mem_used_mib) == (None, 24_600)
    assert "GPM utilization of" in caplog.text
    assert h100_mig.sample(big).util_pct == 55.0  # the next pair measures again
    fake.fail["nvmlGpmMigSampleGet"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuLost):
        h100_mig.sample(big)


def test_destroyed_instance_forgets_its_gpm_sample(fake: FakeNvml, h100_mig: NvmlBackend) -> None:
    small = fake.mig(9, H100_UUID)
    h100_mig.sample(small.uuid)
    h100_mig.destroy_mig(H100_UUID, small.uuid)
    assert fake.gpm_samples == {}


def test_mps_clients_memory_is_counted_once_per_pid(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §1.4: MPS clients are listed by their own NVML call; the old code never
    made it, so an MPS sandbox showed 0 MiB. A pid in both lists counts once."""
    fake.h100.mps_procs = [
        SimpleNamespace(pid=202, usedGpuMemory=1_000 * MIB),
        SimpleNamespace(pid=505, usedGpuMemory=2_048 * MIB),
        SimpleNamespace(pid=606, usedGpuMemory=None),
    ]
    sample = backend.sample(H100_UUID)
    assert sample.mem_by_owner == {"pid:101": 3_100, "pid:202": 1_000, "pid:505": 2_048}
    fake.fail["nvmlDeviceGetMPSComputeRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert backend.sample(H100_UUID).mem_by_owner == {"pid:101": 3_100, "pid:202": 1_000}


@pytest.mark.parametrize("failing", ["nvmlEventSetCreate", "nvmlDeviceRegisterEvents"])
def test_unknown_error_from_events_does_not_stop_the_backend(
    fake: FakeNvml, failing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Guards review §1.5: NVML_ERROR_UNKNOWN from the event set made NvmlBackend() raise,
    so the agent did not start. Now the set is freed and the backend runs without events."""
    fake.fail[failing] = pynvml.NVML_ERROR_UNKNOWN
    backend = NvmlBackend()
    assert "running without NVML events" in caplog.text
    assert fake.freed == (failing == "nvmlDeviceRegisterEvents")
    assert backend.fault_events() == []
    assert len(backend.list_gpus()) == 2
    backend.close()


def test_gpu_instance_without_compute_instance_holds_its_slices(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §1.2: a GPU instance left without a compute instance (`-cgi` without
    `-C`, or a half-failed destroy) was invisible, so its slices looked free and NVML
    refused the next create there. Now it shows (unusable) and can be destroyed."""
    fake._make_instance(fake.a100, 19, start=2, gi_id=9, cis=0)
    a100 = backend.list_gpus()[1]
    assert [(m.profile, m.start) for m in a100.mig_devices] == [("2g.20gb", 0), ("3g.40gb", 4)]
    (orphan,) = a100.unusable_mig
    assert (orphan.uuid, orphan.profile, orphan.start, orphan.compute_instances) == (
        f"{A100_UUID}/gi9",
        "1g.10gb",
        2,
        0,
    )
    assert (orphan.memory_mib, orphan.compute_instance_id, orphan.usable) == (9728, -1, False)
    assert orphan in backend.mig_layout(A100_UUID)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb@2 overlaps 1g\.10gb@2"):
        backend.create_mig(A100_UUID, "1g.10gb", 2)
    assert fake.called("nvmlDeviceCreateGpuInstanceWithPlacement") == []
    backend.destroy_mig(A100_UUID, orphan.uuid)
    assert [m.start for m in backend.mig_layout(A100_UUID)] == [0, 4]
    assert backend.create_mig(A100_UUID, "1g.10gb", 2).usable


def test_gpu_instance_with_two_compute_instances_is_one_entry(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §1.2: two CIs in one GI were two MigDevices with the same placement
    (an overlap to check_layout); now one unusable entry holding the GI's slices."""
    fake._make_instance(fake.a100, 14, start=2, gi_id=5, cis=2)
    layout = backend.mig_layout(A100_UUID)
    assert [(m.profile, m.start, m.compute_instances) for m in layout] == [
        ("2g.20gb", 0, 1),
        ("2g.20gb", 2, 2),
        ("3g.40gb", 4, 1),
    ]
    assert layout[1].uuid == f"{A100_UUID}/gi5"
    fake.pending = [event(fake.a100, pynvml.nvmlEventTypeXidCriticalError, 48, 5)]
    assert [e.uuid for e in backend.fault_events()] == [A100_UUID]  # no device the portal knows
    backend.destroy_mig(A100_UUID, layout[1].uuid)  # both compute instances, then the GI
    assert len(fake.called("nvmlComputeInstanceDestroy")) == 2
    assert [m.start for m in backend.mig_layout(A100_UUID)] == [0, 4]


def test_destroy_refused_while_processes_run(fake: FakeNvml, backend: NvmlBackend) -> None:
    with pytest.raises(GpuBackendError, match="processes still run on it") as caught:
        backend.destroy_mig(A100_UUID, fake.mig(2).uuid)  # pid 404 (an MPS server would do too)
    assert isinstance(caught.value.__cause__, pynvml.NVMLError_InUse)
    assert fake.mig(2).uuid in {m.uuid for m in backend.mig_layout(A100_UUID)}


def test_failed_gpu_instance_destroy_makes_the_compute_instance_again(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Guards review §2.2: CI destroyed, GI destroy refused: the device is usable again (a
    new MIG uuid, named in the error) instead of an invisible GI holding its slices."""
    small = fake.mig(3).uuid
    fake.fail["nvmlGpuInstanceDestroy"] = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(
        GpuBackendError, match="compute instance was made again: the device is now MIG-"
    ) as err:
        backend.destroy_mig(A100_UUID, small)
    again = fake.mig(3).uuid
    assert again != small and again in str(err.value)
    assert next((m.uuid, m.usable) for m in backend.mig_layout(A100_UUID)) == (again, True)


def test_failed_gpu_instance_destroy_leaves_a_visible_instance(fake: FakeNvml, backend: NvmlBackend) -> None:
    small = fake.mig(3).uuid
    fake.fail["nvmlGpuInstanceDestroy"] = pynvml.NVML_ERROR_UNKNOWN
    fake.fail["nvmlGpuInstanceCreateComputeInstance"] = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(GpuBackendError, match=rf"memory slices 0-1 .* as {A100_UUID}/gi3"):
        backend.destroy_mig(A100_UUID, small)
    left = backend.mig_layout(A100_UUID)[0]
    assert (left.uuid, left.start, left.usable) == (f"{A100_UUID}/gi3", 0, False)


def test_mig_on_a_board_without_a_table_takes_placements_from_nvml(
    fake: FakeNvml, h100_mig: NvmlBackend
) -> None:
    """Guards review §2.4: a board scheduler.gpus has no table for (here a made-up Hopper
    name) was refused MIG ("no MIG geometry known"); its placements come from NVML now."""
    fake.h100.name = "NVIDIA H100 SXM5 64GB"
    assert h100_mig.list_gpus()[0].model == ""
    h100_mig.destroy_mig(H100_UUID, fake.mig(9, H100_UUID).uuid)
    with pytest.raises(
        GpuBackendError, match=r"1g\.10gb cannot start at memory slice 7 on .*from NVML.*0, 1, 2"
    ):
        h100_mig.create_mig(H100_UUID, "1g.10gb", 7)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb@3 overlaps 1g\.10gb@3"):
        h100_mig.create_mig(H100_UUID, "1g.10gb", 3)
    made = h100_mig.create_mig(H100_UUID, "1g.10gb", 2)
    assert (made.profile, made.start, made.memory_mib) == ("1g.10gb", 2, 9984)


def test_a_layout_does_not_keep_an_instance_no_sandbox_can_use(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Review §1.2/§2.2: a GPU instance without a compute instance has the profile and start
    a layout may want; kept as it stands, the layout would hold a slice nothing can run on.
    It is destroyed and made again, whole."""
    from workers.gpu.mig import MigManager

    fake._make_instance(fake.a100, 19, start=2, gi_id=9, cis=0)
    MigManager(backend).apply(A100_UUID, [("2g.20gb", 0), ("1g.10gb", 2), ("3g.40gb", 4)])
    layout = backend.mig_layout(A100_UUID)
    assert [(m.profile, m.start, m.usable) for m in layout] == [
        ("2g.20gb", 0, True),
        ("1g.10gb", 2, True),
        ("3g.40gb", 4, True),
    ]
