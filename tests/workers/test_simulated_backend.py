"""SimulatedBackend: MIG geometry, deterministic UUIDs, load-driven telemetry, fault hooks."""

from __future__ import annotations

import threading
import uuid as uuidlib
from collections.abc import Callable
from functools import partial

import pytest

from scheduler.gpus import MEMORY_SLICES, MODELS, model_for_name
from workers.gpu import make_backend
from workers.gpu.base import GpuBackend, GpuBackendError, GpuLost
from workers.gpu.simulated import (
    SimulatedBackend,
    SimulatedGpuConfig,
    default_mig_layout,
    parse_sim_spec,
)

H100_LEGAL_STARTS = {
    "1g.10gb": {0, 1, 2, 3, 4, 5, 6},
    "1g.20gb": {0, 2, 4, 6},
    "2g.20gb": {0, 2, 4},
    "3g.40gb": {0, 4},
    "4g.40gb": {0},
    "7g.80gb": {0},
}


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def whole_gpu(model: str = "H100-80GB", clock: FakeClock | None = None) -> SimulatedBackend:
    return SimulatedBackend("host-a", [SimulatedGpuConfig(model)], clock=clock or FakeClock())


def empty_mig_gpu(model: str = "H100-80GB") -> tuple[SimulatedBackend, str]:
    """A MIG-enabled GPU with no instances (MIG GPUs start with the default layout)."""
    backend = SimulatedBackend("host-a", [SimulatedGpuConfig(model, mig=True)], clock=FakeClock())
    gpu = backend.list_gpus()[0].uuid
    for mig in backend.mig_layout(gpu):
        backend.destroy_mig(gpu, mig.uuid)
    assert backend.mig_layout(gpu) == []
    return backend, gpu


# -- MIG geometry ----------------------------------------------------------------------------


@pytest.mark.parametrize("profile", sorted(H100_LEGAL_STARTS))
@pytest.mark.parametrize("start", range(MEMORY_SLICES))
def test_h100_placements_follow_nvidia_table(profile: str, start: int) -> None:
    backend, gpu = empty_mig_gpu()
    if start in H100_LEGAL_STARTS[profile]:
        mig = backend.create_mig(gpu, profile, start)
        assert (mig.profile, mig.start, mig.parent_uuid) == (profile, start, gpu)
        assert backend.mig_layout(gpu) == [mig]
    else:
        with pytest.raises(GpuBackendError, match=rf"{profile} cannot start at memory slice {start}"):
            backend.create_mig(gpu, profile, start)
        assert backend.mig_layout(gpu) == []


def test_overlapping_start_is_refused_and_names_the_instance() -> None:
    backend, gpu = empty_mig_gpu()
    backend.create_mig(gpu, "3g.40gb", 0)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb@2 overlaps 3g\.40gb@0"):
        backend.create_mig(gpu, "1g.10gb", 2)
    with pytest.raises(GpuBackendError, match="overlaps"):
        backend.create_mig(gpu, "7g.80gb", 0)
    assert backend.create_mig(gpu, "3g.40gb", 4).start == 4


def test_seven_small_slices_fill_the_gpu() -> None:
    backend, gpu = empty_mig_gpu()
    migs = [backend.create_mig(gpu, "1g.10gb", start) for start in range(7)]
    assert len({m.uuid for m in migs}) == 7
    assert len({m.gpu_instance_id for m in migs}) == 7
    assert all(0 <= m.gpu_instance_id < 16 and m.compute_instance_id == 0 for m in migs)
    with pytest.raises(GpuBackendError, match="overlaps"):
        backend.create_mig(gpu, "1g.20gb", 6)


def test_mig_errors_name_the_problem() -> None:
    backend, gpu = empty_mig_gpu()
    with pytest.raises(GpuBackendError, match=r"no MIG profile '5g\.50gb'.*1g\.10gb"):
        backend.create_mig(gpu, "5g.50gb", 0)
    with pytest.raises(GpuBackendError, match="no GPU GPU-nope"):
        backend.create_mig("GPU-nope", "1g.10gb", 0)
    with pytest.raises(GpuBackendError, match="is not a MIG device"):
        backend.destroy_mig(gpu, "MIG-nope")
    plain = whole_gpu()
    with pytest.raises(GpuBackendError, match="MIG mode is disabled"):
        plain.create_mig(plain.list_gpus()[0].uuid, "1g.10gb", 0)


def test_destroy_refuses_an_instance_in_use() -> None:
    backend, gpu = empty_mig_gpu()
    mig = backend.create_mig(gpu, "2g.20gb", 2)
    backend.note_load("alloc-1", [mig.uuid], 1000, 50.0)
    with pytest.raises(GpuBackendError, match="in use by alloc-1"):
        backend.destroy_mig(gpu, mig.uuid)
    backend.forget_load("alloc-1")
    backend.destroy_mig(gpu, mig.uuid)
    assert backend.mig_layout(gpu) == []


def test_one_media_extension_instance_per_gpu() -> None:
    # Memory slices alone would allow it; NVML refuses a second +me (one set of JPEG/OFA).
    backend, gpu = empty_mig_gpu()
    backend.create_mig(gpu, "1g.10gb+me", 0)
    with pytest.raises(GpuBackendError, match=r"1g\.10gb\+me@1 on .*2 instances with media extensions"):
        backend.create_mig(gpu, "1g.10gb+me", 1)
    assert [m.profile for m in backend.mig_layout(gpu)] == ["1g.10gb+me"]
    assert backend.create_mig(gpu, "1g.10gb", 1).start == 1


@pytest.mark.parametrize("model", [m.name for m in MODELS.values() if m.mig_capable])
def test_default_layout_is_legal_and_uses_every_slice(model: str) -> None:
    layout = default_mig_layout(model)
    backend = SimulatedBackend("h", [SimulatedGpuConfig(model, mig=True)], clock=FakeClock())
    migs = backend.list_gpus()[0].mig_devices
    assert [(m.profile, m.start) for m in sorted(migs, key=lambda m: m.start)] == sorted(
        layout, key=lambda p: p[1]
    )
    assert sum(m.memory_slices for m in migs) == MEMORY_SLICES
    profiles = MODELS[model]
    assert sum(profiles.profile(m.profile).compute_slices for m in migs) == 7
    # The name a simulated GPU shows maps back to its model, as NVML's would.
    name = backend.list_gpus()[0].name
    found = model_for_name(name, profiles.memory_mib)
    assert found is not None and found.name == model


def test_configured_layout_and_bad_configs() -> None:
    layout = (("7g.80gb", 0),)
    backend = SimulatedBackend("h", [SimulatedGpuConfig("A100-80GB", True, layout)])
    assert [m.profile for m in backend.list_gpus()[0].mig_devices] == ["7g.80gb"]
    with pytest.raises(ValueError, match=r"bad MIG layout.*cannot start"):
        SimulatedBackend("h", [SimulatedGpuConfig("H100-80GB", True, (("3g.40gb", 2),))])
    with pytest.raises(ValueError, match="needs mig=True"):
        SimulatedBackend("h", [SimulatedGpuConfig("H100-80GB", False, layout)])
    with pytest.raises(ValueError, match="unknown GPU model 'V100'"):
        SimulatedBackend("h", [SimulatedGpuConfig("V100")])


# -- identity --------------------------------------------------------------------------------


def test_uuids_are_deterministic_per_host_and_index() -> None:
    configs = parse_sim_spec("H100-80GB:2:mig=1")
    first = SimulatedBackend("host-a", configs).list_gpus()
    again = SimulatedBackend("host-a", configs, seed=7).list_gpus()  # an agent restart
    other = SimulatedBackend("host-b", configs).list_gpus()
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert [m.uuid for m in first[1].mig_devices] == [m.uuid for m in again[1].mig_devices]
    assert {g.uuid for g in first}.isdisjoint(g.uuid for g in other)
    assert all(g.uuid.startswith("GPU-") and g.simulated for g in first)
    uuidlib.UUID(first[0].uuid.removeprefix("GPU-"))
    mig = first[1].mig_devices[0]
    assert mig.uuid.startswith("MIG-")
    uuidlib.UUID(mig.uuid.removeprefix("MIG-"))


def test_recreated_instance_gets_the_same_uuid() -> None:
    backend, gpu = empty_mig_gpu()
    before = backend.create_mig(gpu, "2g.20gb", 4)
    backend.destroy_mig(gpu, before.uuid)
    assert backend.create_mig(gpu, "2g.20gb", 4).uuid == before.uuid


def test_inventory_names_map_back_to_models() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB;A100-80GB;A100-40GB"))
    gpus = backend.list_gpus()
    assert [g.model for g in gpus] == ["H100-80GB", "A100-80GB", "A100-40GB"]
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[2].memory_mib == MODELS["A100-40GB"].memory_mib
    assert backend.name == "simulated" and backend.simulated


# -- spec parsing ----------------------------------------------------------------------------


def test_parse_sim_spec() -> None:
    configs = parse_sim_spec(" H100-80GB:4:mig=0,1 ; A100-80GB:2 ")
    assert [c.model for c in configs] == ["H100-80GB"] * 4 + ["A100-80GB"] * 2
    assert [c.mig for c in configs] == [True, True, False, False, False, False]
    assert parse_sim_spec("") == []
    assert parse_sim_spec("A100-40GB") == [SimulatedGpuConfig("A100-40GB")]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("B200:1", "unknown GPU model 'B200'"),
        ("H100-80GB:x", "bad GPU count 'x'"),
        ("H100-80GB:0", "at least 1"),
        ("H100-80GB:2:mig=2", r"MIG indices \[2\] out of range"),
        ("H100-80GB:2:mig=a", "bad MIG indices"),
    ],
)
def test_parse_sim_spec_rejects(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sim_spec(spec)


def test_make_backend_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.gpu.nvml_problem", lambda: "NVML sees no GPU")
    backend = make_backend("auto", "host-a", "A100-80GB:2", driver_paths=())
    assert isinstance(backend, SimulatedBackend) and len(backend.list_gpus()) == 2
    assert make_backend("simulated", "host-a", "").list_gpus() == []
    with pytest.raises(ValueError, match="'cuda'"):
        make_backend("cuda", "host-a", "")


# -- telemetry -------------------------------------------------------------------------------


def test_idle_sample() -> None:
    backend = whole_gpu()
    gpu = backend.list_gpus()[0].uuid
    sample = backend.sample(gpu)
    model = MODELS["H100-80GB"]
    assert 30 <= sample.temp_c <= 36
    assert sample.util_pct == 0
    assert model.idle_w * 0.98 <= sample.power_w <= model.idle_w * 1.02
    assert sample.mem_used_mib == 512 and sample.mem_total_mib == model.memory_mib
    assert sample.sm_clock_mhz < model.max_sm_clock_mhz / 2
    assert sample.throttle == ("gpu_idle",)
    assert sample.mem_by_owner == {}
    assert sample.t_ms == 1_700_000_000_000


def test_temperature_and_power_follow_load_and_fall_back() -> None:
    clock = FakeClock()
    backend = whole_gpu(clock=clock)
    gpu = backend.list_gpus()[0].uuid
    idle = backend.sample(gpu)
    backend.note_load("alloc-1", [gpu], 20_000, 100.0)
    clock.t += 25  # one time constant: about 63 % of the way to equilibrium
    one_tau = backend.sample(gpu)
    rise = (one_tau.temp_c - idle.temp_c) / (76 - 33)
    assert 0.55 < rise < 0.72
    clock.t += 300
    hot = backend.sample(gpu)
    model = MODELS["H100-80GB"]
    assert 70 <= hot.temp_c <= 80
    assert hot.power_w >= model.tdp_w * 0.95
    assert hot.util_pct is not None and hot.util_pct >= 97
    assert hot.sm_clock_mhz >= model.max_sm_clock_mhz * 0.9
    assert "gpu_idle" not in hot.throttle
    backend.forget_load("alloc-1")
    clock.t += 300
    cooled = backend.sample(gpu)
    assert cooled.temp_c < 37 and cooled.util_pct == 0
    assert cooled.power_w < model.idle_w * 1.05


@pytest.mark.parametrize("step_s", [0.1, 1.0, 10.0])
def test_thermal_curve_does_not_depend_on_sampling_rate(step_s: float) -> None:
    reference_clock, clock = FakeClock(), FakeClock()
    reference, backend = whole_gpu(clock=reference_clock), whole_gpu(clock=clock)
    gpu = backend.list_gpus()[0].uuid
    for b in (reference, backend):
        b.note_load("alloc-1", [gpu], 1000, 60.0)
    for _ in range(round(30 / step_s)):
        clock.t += step_s
        backend.sample(gpu)
    reference_clock.t += 30
    # Only the ±0.3 °C sample noise may differ.
    assert abs(backend.sample(gpu).temp_c - reference.sample(gpu).temp_c) <= 0.7


def test_memory_held_by_owners() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("A100-40GB:2"), clock=FakeClock())
    gpu0, gpu1 = (g.uuid for g in backend.list_gpus())
    backend.note_load("alloc-1", [gpu0, gpu1], 10_000, 40.0)
    backend.note_load("alloc-2", [gpu0], 5_000, 30.0)
    sample = backend.sample(gpu0)
    assert sample.mem_by_owner == {"alloc-1": 10_000, "alloc-2": 5_000}
    assert sample.mem_used_mib == 512 + 15_000
    assert sample.util_pct is not None and 65 <= sample.util_pct <= 75
    assert backend.sample(gpu1).mem_by_owner == {"alloc-1": 10_000}
    backend.note_load("alloc-3", [gpu0], 40_000, 10.0)
    assert backend.sample(gpu0).mem_used_mib == MODELS["A100-40GB"].memory_mib  # capped
    for owner in ("alloc-1", "alloc-2", "alloc-3"):
        backend.forget_load(owner)
    assert backend.sample(gpu0).mem_used_mib == 512
    backend.forget_load("never-there")


def test_mig_load_lands_on_parent_scaled_by_share() -> None:
    backend, gpu = empty_mig_gpu()
    big = backend.create_mig(gpu, "3g.40gb", 4)
    small = backend.create_mig(gpu, "1g.10gb", 0)
    backend.note_load("alloc-1", [big.uuid], 8_000, 100.0)
    parent, device, idle_device = (
        backend.sample(gpu),
        backend.sample(big.uuid),
        backend.sample(small.uuid),
    )
    assert parent.util_pct is not None and abs(parent.util_pct - 100 * 3 / 7) <= 2.5
    assert device.util_pct is not None and device.util_pct >= 97 and idle_device.util_pct == 0
    assert device.mem_total_mib == big.memory_mib
    assert device.mem_used_mib == 16 + 8_000 and device.mem_by_owner == {"alloc-1": 8_000}
    assert parent.mem_by_owner == {"alloc-1": 8_000} and parent.mem_used_mib == 512 + 8_000
    assert idle_device.mem_by_owner == {}
    # Temperature, power and clocks are the board's.
    assert abs(device.temp_c - parent.temp_c) <= 0.7
    assert abs(device.power_w - parent.power_w) <= parent.power_w * 0.03


def test_samples_are_reproducible_for_a_seed() -> None:
    def run(seed: int) -> list[float | None]:
        clock = FakeClock()
        backend = SimulatedBackend("h", parse_sim_spec("H100-80GB"), seed=seed, clock=clock)
        gpu = backend.list_gpus()[0].uuid
        backend.note_load("a", [gpu], 100, 50.0)
        values: list[float | None] = []
        for _ in range(20):
            clock.t += 0.5
            sample = backend.sample(gpu)
            values += [sample.util_pct, sample.power_w, sample.temp_c]
        return values

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_note_load_rejects_unknown_devices() -> None:
    backend = whole_gpu()
    with pytest.raises(GpuBackendError, match="MIG-nope"):
        backend.note_load("a", ["MIG-nope"], 1, 1.0)
    with pytest.raises(GpuBackendError, match="GPU-nope"):
        backend.sample("GPU-nope")


# -- faults ----------------------------------------------------------------------------------


def test_xid_injection_is_drained_once() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1:mig=0"), clock=FakeClock())
    mig = backend.list_gpus()[0].mig_devices[0]
    backend.inject_xid(mig.uuid, 43)
    backend.inject_xid(mig.uuid, 79)
    events = backend.fault_events()
    # 43 is the tenant's own (a killed kernel): app_xid; 79 (fell off the bus) is the board's
    assert [(e.uuid, e.kind, e.xid) for e in events] == [(mig.uuid, "app_xid", 43), (mig.uuid, "xid", 79)]
    assert events[0].t_ms == 1_700_000_000_000
    assert backend.fault_events() == []


def test_overheat_throttles_and_leaves_the_verdict_to_the_temperature_rule() -> None:
    clock = FakeClock()
    backend = whole_gpu(clock=clock)
    gpu = backend.list_gpus()[0].uuid
    normal_clock = backend.sample(gpu).sm_clock_mhz
    backend.note_load("a", [gpu], 100, 100.0)
    clock.t += 120
    cool_loaded = backend.sample(gpu)
    backend.inject_overheat(gpu, 95.0)
    hot = backend.sample(gpu)
    assert hot.temp_c >= 94
    assert "sw_thermal" in hot.throttle and "hw_slowdown" in hot.throttle
    assert hot.sm_clock_mhz < cool_loaded.sm_clock_mhz * 0.6 and normal_clock > 0
    # One temperature rule, the alert policy's, judged on the agent (workers.host.faults).
    assert backend.fault_events() == []
    clock.t += 200
    cooled = backend.sample(gpu)
    assert cooled.temp_c < 80 and "sw_thermal" not in cooled.throttle


def test_lost_gpu_leaves_inventory_and_fails_calls() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2"), clock=FakeClock())
    lost, kept = (g.uuid for g in backend.list_gpus())
    backend.mark_lost(lost)
    backend.mark_lost(lost)
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(lost, "gpu_lost")]
    assert [g.uuid for g in backend.list_gpus()] == [kept]
    with pytest.raises(GpuLost, match="is lost") as caught:
        backend.sample(lost)
    assert caught.value.uuid == lost
    with pytest.raises(GpuBackendError, match="is lost"):
        backend.mig_layout(lost)
    backend.sample(kept)


def test_mig_utilization_can_be_unmeasured() -> None:
    """As NVML without GPM: MIG devices and a GPU in MIG mode say None, never 0 (idle)."""
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2:mig=1"), mig_util_unmeasured=True)
    plain, mig_gpu = backend.list_gpus()
    device = mig_gpu.mig_devices[0]
    backend.note_load("a", [device.uuid], 100, 80.0)
    assert backend.sample(device.uuid).util_pct is None
    assert backend.sample(mig_gpu.uuid).util_pct is None
    assert backend.sample(plain.uuid).util_pct == 0.0


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_sampling_loading_and_mig_changes() -> None:
    backend: GpuBackend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2:mig=1"))
    plain, mig_gpu = (g.uuid for g in backend.list_gpus())
    errors: list[BaseException] = []
    stop = threading.Event()

    def guarded(work: Callable[[], None]) -> None:
        try:
            while not stop.is_set():
                work()
        except BaseException as exc:  # a failure in any thread fails the test
            errors.append(exc)

    def sampler() -> None:
        backend.list_gpus()
        for device in steady:  # the reshaper's instance may vanish between list and sample
            backend.sample(device)
        backend.fault_events()

    def loader(name: str) -> None:
        backend.note_load(name, [plain], 1000, 50.0)
        backend.forget_load(name)

    def reshaper() -> None:
        mig = backend.create_mig(mig_gpu, "1g.20gb", 6) if len(backend.mig_layout(mig_gpu)) < 5 else None
        if mig is not None:
            backend.destroy_mig(mig_gpu, mig.uuid)

    backend.destroy_mig(mig_gpu, backend.mig_layout(mig_gpu)[-1].uuid)  # frees slices 4-7
    steady = [plain, mig_gpu] + [m.uuid for m in backend.mig_layout(mig_gpu)]
    threads = [threading.Thread(target=guarded, args=(sampler,)) for _ in range(3)]
    threads += [threading.Thread(target=guarded, args=(partial(loader, f"alloc-{i}"),)) for i in range(3)]
    threads.append(threading.Thread(target=guarded, args=(reshaper,)))
    for thread in threads:
        thread.start()
    stop.wait(0.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert backend.sample(plain).mem_by_owner == {}
    assert len(backend.mig_layout(mig_gpu)) == 3


def test_ecc_counts_follow_injection() -> None:
    backend = SimulatedBackend("host-a", [SimulatedGpuConfig("H100-80GB", mig=True)], clock=FakeClock())
    gpu = backend.list_gpus()[0]
    mig = gpu.mig_devices[0]
    idle = backend.sample(gpu.uuid)
    assert (idle.ecc_corrected, idle.ecc_uncorrected) == (0, 0)
    backend.inject_ecc(mig.uuid, corrected=5)
    backend.inject_ecc(mig.uuid, corrected=2, uncorrected=1)
    for uuid in (gpu.uuid, mig.uuid):  # counted per board, as NVML does
        sample = backend.sample(uuid)
        assert (sample.ecc_corrected, sample.ecc_uncorrected) == (7, 1)
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(mig.uuid, "ecc_dbe")]


# -- the Alibaba trace's models (the cluster twin's hosts) --------------------------------


def test_the_trace_models_are_simulated_with_their_names_and_memory() -> None:
    backend = SimulatedBackend("twin-1", parse_sim_spec("T4:2;V100M32:1;G2:1"), clock=FakeClock())
    gpus = backend.list_gpus()
    assert [(g.model, g.name, g.memory_mib) for g in gpus] == [
        ("T4", "Tesla T4", 15109), ("T4", "Tesla T4", 15109),
        ("V100M32", "Tesla V100-SXM2-32GB", 32510), ("G2", "Alibaba trace G2 (anonymised)", 20000),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="T4 does not support MIG"):
        parse_sim_spec("T4:2:mig=0")
    with pytest.raises(ValueError, match="unknown GPU model 'K80'"):
        parse_sim_spec("K80:1")


def test_a_model_of_unknown_power_raises_no_power_cap_and_still_warms() -> None:
    """G1-G3 publish memory only (0 W, 0 MHz): no division by their zero TDP, no power cap
    reason that would raise an alert on every sample."""
    clock = FakeClock()
    backend = SimulatedBackend("twin-1", parse_sim_spec("G3:1"), clock=clock)
    gpu = backend.list_gpus()[0].uuid
    idle = backend.sample(gpu)
    backend.note_load("alloc-1", [gpu], 1000, 100.0)
    clock.t += 300
    busy = backend.sample(gpu)
    assert idle.power_w == busy.power_w == 0 and busy.sm_clock_mhz == 0
    assert "sw_power_cap" not in busy.throttle and "gpu_idle" not in busy.throttle
    assert busy.temp_c > idle.temp_c + 20 and busy.util_pct is not None and busy.util_pct >= 97
