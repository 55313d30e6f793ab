"""The agent's sampling helpers: sampling each device on its own, utilization windows that
skip unmeasured samples, and the sandboxes an event concerns (issue 18)."""

from __future__ import annotations

from tests.workers.nvml_fake import A100_UUID, H100_UUID, FakeNvml
from workers.gpu.base import GpuBackend, GpuSample
from workers.gpu.nvml import NvmlBackend
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.faults import sandboxes_hit
from workers.host.sampler import TickSamples
from workers.host.utilization import UtilWindow


def sample_all(backend: GpuBackend, uuids: list[str], parent_of: dict[str, str]) -> TickSamples:
    """Each of ``uuids`` asked once, in order, as the sampler's tick asks its devices."""
    tick = TickSamples(backend, parent_of)
    for uuid in uuids:
        tick.get(uuid)
    return tick


def test_a_lost_gpu_does_not_stop_the_others(fake: FakeNvml, backend: NvmlBackend) -> None:
    """Guards review §0 #7: one lost GPU aborted the whole tick, fault report included."""
    gpus = backend.list_gpus()
    parent_of = {m.uuid: g.uuid for g in gpus for m in g.mig_devices}
    migs = list(parent_of)
    fake.lost.add(A100_UUID)
    got = sample_all(backend, [H100_UUID, migs[0], A100_UUID, migs[1], "GPU-nope"], parent_of)
    assert list(got.samples) == [H100_UUID]
    assert got.lost == {A100_UUID}
    assert list(got.failed) == ["GPU-nope"]
    assert [(e.uuid, e.kind) for e in backend.fault_events()] == [(A100_UUID, "gpu_lost")]


def test_a_mig_device_sampled_before_its_gpu_was_found_lost_is_dropped() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1:mig=0"))
    gpu = backend.list_gpus()[0]
    mig = gpu.mig_devices[0].uuid
    asked: list[str] = []

    class LosesOnSecondCall(SimulatedBackend):
        def sample(self, uuid: str) -> GpuSample:
            asked.append(uuid)
            if asked[1:]:
                self.mark_lost(gpu.uuid)
            return super().sample(uuid)

    backend.__class__ = LosesOnSecondCall
    got = sample_all(
        backend, [mig, gpu.uuid, gpu.mig_devices[1].uuid], {m.uuid: gpu.uuid for m in gpu.mig_devices}
    )
    assert (got.samples, got.lost, asked) == ({}, {gpu.uuid}, [mig, gpu.uuid])


def test_unmeasured_samples_hold_time_but_not_the_mean() -> None:
    """Guards review §1.3: None (a MIG device without GPM) averaged in as 0 read as idle."""
    window = UtilWindow(60)
    assert window.mean() is None
    for second in range(30):
        window.add(second * 1000, None)
    assert window.mean() == (None, 29.0)  # nothing measured: culling skips it
    window.add(30_000, 80.0)
    window.add(31_000, 60.0)
    assert window.mean() == (70.0, 31.0)
    window.add(100_000, None)  # the measured ones have left the window
    assert window.mean() == (None, 0.0)


def test_an_event_concerns_the_sandboxes_on_its_device() -> None:
    parent_of = {"MIG-a": "GPU-1", "MIG-b": "GPU-1"}
    devices_of = {1: ["MIG-a"], 2: ["MIG-b"], 3: ["GPU-2"], 4: ["GPU-1"]}
    assert sandboxes_hit("MIG-a", devices_of, parent_of) == [1]  # one tenant's instance
    assert sandboxes_hit("GPU-1", devices_of, parent_of) == [1, 2, 4]  # the board
    assert sandboxes_hit("GPU-3", devices_of, parent_of) == []
