"""Each sandbox's own figures on a shared GPU (issue 36, items 2, 3 and 7): per-process
utilization from NVML (the fake) and from the simulated backend, summed per sandbox through
the pid -> sandbox map; its chart, rollups and culling window get its own figure; its memory
summed over its processes is watched against its share (warn, stop after the grace, clear)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from django.conf import settings
from redis.asyncio import Redis as AsyncRedis

from tests.workers.nvml_fake import A100_UUID, H100_UUID, MIB, FakeNvml
from wire.spec import OVER_SHARE_STOP, MemoryShare, MpsShare, SandboxHandle, SandboxSpec
from wire.telemetry import read_latest
from workers.drivers.base import DriverError, SandboxStatus
from workers.drivers.simulated import SimulatedDriver, chosen_load, simulated_load
from workers.gpu.nvml import NvmlBackend
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host import sampler as sampler_module
from workers.host.agent import Agent
from workers.host.share_watch import ShareWatch

GIB = 1024

# -- NVML: per-process utilization -----------------------------------------------------------


def test_each_process_gets_its_own_utilization_since_the_last_sample(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Guards review-3 new #10: every holder of a GPU was given the GPU's utilization."""
    first = fake.record_process_util(fake.h100, {101: 92, 202: 0})  # 202 idle: NVML lists it not
    assert backend.sample(H100_UUID).util_by_owner == {"pid:101": 92.0}
    # Nothing newer than the last sample: NOT_FOUND, every process idle (measured, not unknown).
    assert backend.sample(H100_UUID).util_by_owner == {}
    fake.record_process_util(fake.h100, {202: 40})
    assert backend.sample(H100_UUID).util_by_owner == {"pid:202": 40.0}
    asked = [args[1] for args in fake.called("nvmlDeviceGetProcessesUtilizationInfo")]
    assert asked == [0, first, first]  # each read passes the newest timestamp seen on that device


def test_a_driver_before_r550_is_read_with_the_older_call(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.processes_util_info = False  # nvmlDeviceGetProcessesUtilizationInfo: FUNCTION_NOT_FOUND
    fake.record_process_util(fake.h100, {101: 30})
    assert backend.sample(H100_UUID).util_by_owner == {"pid:101": 30.0}
    backend.sample(H100_UUID)
    assert len(fake.called("nvmlDeviceGetProcessesUtilizationInfo")) == 1  # tried once, then not again
    assert len(fake.called("nvmlDeviceGetProcessUtilization")) == 2


def test_mig_devices_and_a_gpu_in_mig_mode_are_unmeasured_per_process(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    mig = backend.list_gpus()[1].mig_devices[0].uuid
    assert backend.sample(A100_UUID).util_by_owner is None
    assert backend.sample(mig).util_by_owner is None  # never {}: that would read every tenant idle


def test_a_failing_read_is_unmeasured_and_the_sample_still_comes(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    fake.fail["nvmlDeviceGetProcessesUtilizationInfo"] = pynvml.NVML_ERROR_UNKNOWN
    got = backend.sample(H100_UUID)
    assert got.util_by_owner is None and got.util_pct == 55.0


def test_mps_clients_are_measured_only_once_samples_prove_they_name_the_clients(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    """NVIDIA's MPS docs: the server "will appear as the active CUDA process rather than any of
    the client processes". Whether per-process samples name the clients on Volta+ is
    unverified: until a sample shows it, an MPS device is unmeasured per process."""
    fake.h100.mps_procs = [
        SimpleNamespace(pid=505, usedGpuMemory=MIB),
        SimpleNamespace(pid=606, usedGpuMemory=MIB),
    ]
    assert backend.sample(H100_UUID).util_by_owner is None  # nothing proves it yet
    fake.record_process_util(fake.h100, {505: 70})
    assert backend.sample(H100_UUID).util_by_owner == {"pid:505": 70.0}
    assert backend.sample(H100_UUID).util_by_owner == {}  # then idle reads idle

    server_named = NvmlBackend()  # a driver that reports the clients' work as the server's
    try:
        fake.record_process_util(fake.h100, {999: 80})
        assert server_named.sample(H100_UUID).util_by_owner is None
        fake.record_process_util(fake.h100, {505: 10})
        assert server_named.sample(H100_UUID).util_by_owner is None  # for good: no 0 % between
    finally:
        server_named.close()


# -- the simulated backend and driver ----------------------------------------------------------


def test_the_simulated_backend_gives_each_owner_its_share_of_a_time_sliced_gpu() -> None:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2:mig=1"))
    gpu, mig_gpu = backend.list_gpus()
    backend.note_load("busy", [gpu.uuid], 30 * GIB, 90.0)
    backend.note_load("idle", [gpu.uuid], 2 * GIB, 0.0)
    assert backend.sample(gpu.uuid).util_by_owner == {"busy": 90.0, "idle": 0.0}
    backend.note_load("idle", [gpu.uuid], 2 * GIB, 90.0)  # together over 100 %: the slices split it
    assert backend.sample(gpu.uuid).util_by_owner == {"busy": 50.0, "idle": 50.0}
    mig = mig_gpu.mig_devices[0].uuid
    backend.note_load("on-mig", [mig], GIB, 60.0)
    assert backend.sample(mig).util_by_owner is None  # as NVML: nothing per process on MIG
    assert backend.sample(mig_gpu.uuid).util_by_owner is None


def test_a_simulated_sandbox_s_command_chooses_its_load(tmp_path: Path) -> None:
    share = MemoryShare(kind="timeslice", memory_mib=20 * GIB, replicas=4)
    base = timeslice_spec("a1", 7, "GPU-x", share)
    assert simulated_load(base, 80 * GIB) == (16 * GIB, 85.0)  # by default within its share
    idle = replace(base, command=("gpushare-sim-load", "util=0"))
    assert simulated_load(idle, 80 * GIB) == (16 * GIB, 0.0)
    hog = replace(base, command=("/usr/bin/gpushare-sim-load", "util=40", "mem_mib=30000"))
    assert simulated_load(hog, 80 * GIB) == (30000, 40.0)
    assert chosen_load(("python", "train.py")) == (None, None)
    bad = replace(base, command=("gpushare-sim-load", "util=150"))
    with pytest.raises(DriverError, match="cannot read 'util=150'"):
        SimulatedDriver(tmp_path).launch(bad)


# -- the agent: each sandbox's own figures on one time-sliced GPU ----------------------------


class CgroupDriver:
    """The driver's side of attribution: each sandbox's host pids (as its cgroup lists them)."""

    name = "cgroups"
    storage_dir = None

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pid_map = pids

    def list_owned(self) -> list[SandboxHandle]:
        return [SandboxHandle(self.name, key, 0, key) for key in self.pid_map]

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus(state="running", started_at_ms=1)

    def pids(self, handle: SandboxHandle) -> list[int]:
        return self.pid_map[handle.allocation_key]


class FakeLayer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        self.sent.append((group, message))


def timeslice_spec(key: str, sandbox_id: int, device: str, share: MemoryShare | None) -> SandboxSpec:
    return SandboxSpec(
        key, sandbox_id, "h", "p", "o", "img", (), (device,), True, tier="slice", memory_share=share
    )


def ticks(agent: Agent, layer: FakeLayer, clock: dict[str, int], n: int, each: Any = None) -> None:
    async def run() -> None:
        client = AsyncRedis.from_url(settings.REDIS_URL)
        for tick in range(n):
            if each is not None:
                each(tick)
            agent.sampler.close_minute()
            await agent.sampler.publish_all(layer, tick, client)
            clock["now"] += 1000
        await client.aclose()

    asyncio.run(run())


@pytest.fixture
def nvml_agent(
    fake: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Agent, FakeLayer, dict[str, int]]]:
    """Two tenants on the H100, time-sliced: sandbox 7 (pids 101, 102) and 8 (pid 202)."""
    fake.h100.procs = []
    driver = CgroupDriver({"busy": [101, 102], "idle": [202]})
    agent = Agent("h", NvmlBackend(), driver, tmp_path)  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    share = MemoryShare(kind="timeslice", memory_mib=20 * GIB, replicas=4)
    agent.context.sandboxes.running["busy"] = timeslice_spec("busy", 7, H100_UUID, share)
    agent.context.sandboxes.running["idle"] = timeslice_spec("idle", 8, H100_UUID, share)
    agent.reports.refresh_pid_owners(driver.list_owned())
    clock = {"now": 60_000}
    monkeypatch.setattr(sampler_module, "now_ms", lambda: clock["now"])
    yield agent, FakeLayer(), clock
    agent.context.backend.close()


def test_a_busy_and_an_idle_tenant_each_get_their_own_utilization(
    fake: FakeNvml, nvml_agent: tuple[Agent, FakeLayer, dict[str, int]], sent_tasks: Any
) -> None:
    """Guards review-3 new #10: the idle tenant beside a busy one showed the GPU's 95 % on its
    page, in /metrics and its rollups, and was never culled."""
    agent, layer, clock = nvml_agent
    fake.h100.util = 95
    ticks(agent, layer, clock, 5, lambda _: fake.record_process_util(fake.h100, {101: 60, 102: 35}))
    own = {
        group: m["sandboxes"][group.rsplit(".", 1)[1]]["util_pct"]
        for group, m in layer.sent
        if group.startswith("host.h.sandbox.") and m["type"] == "gpu.sample"
    }
    assert own == {
        "host.h.sandbox.7": 95.0,
        "host.h.sandbox.8": 0.0,
    }  # its two processes summed; the idle one idle
    assert agent.context.utilization.over_window("busy") == (95.0, 4.0)
    assert agent.context.utilization.over_window("idle") == (0.0, 4.0)  # what culling judges
    [gpu_message] = [m for m in read_latest_sync().values() if m["gpu"] == H100_UUID]
    assert gpu_message["sandboxes"] == {  # what /metrics reads
        "7": {"mem_mib": 0, "util_pct": 95.0},
        "8": {"mem_mib": 0, "util_pct": 0.0},
    }
    clock["now"] = 120_000
    minute = agent.sampler.close_minute()  # the rollups the bill's used/idle split reads
    assert minute is not None
    assert minute["sandboxes"]["7"]["util_pct"] == [95.0, 95.0, 95.0]
    assert minute["sandboxes"]["8"]["util_pct"] == [0.0, 0.0, 0.0]


def test_a_shared_gpu_that_cannot_measure_per_process_leaves_its_tenants_unmeasured(
    fake: FakeNvml, nvml_agent: tuple[Agent, FakeLayer, dict[str, int]], sent_tasks: Any
) -> None:
    agent, layer, clock = nvml_agent
    fake.h100.mps_procs = [SimpleNamespace(pid=101, usedGpuMemory=GIB * MIB)]  # MPS, unproven
    fake.record_process_util(fake.h100, {999: 95})  # the server's pid, not a client's
    ticks(agent, layer, clock, 3)
    figures = [
        m["sandboxes"] for g, m in layer.sent if g.startswith("host.h.sandbox.") and m["type"] == "gpu.sample"
    ]
    assert {u["util_pct"] for f in figures for u in f.values()} == {None}  # never the GPU's 55 %
    assert agent.context.utilization.over_window("idle") == (None, 2.0)  # culling skips it
    clock["now"] = 120_000
    minute = agent.sampler.close_minute()
    assert minute is not None and minute["sandboxes"]["8"]["util_pct"] is None  # unmeasured, not idle


def test_a_dedicated_gpu_keeps_the_device_utilization(
    fake: FakeNvml, nvml_agent: tuple[Agent, FakeLayer, dict[str, int]], sent_tasks: Any
) -> None:
    agent, layer, clock = nvml_agent
    del agent.context.sandboxes.running["idle"]
    agent.context.sandboxes.running["busy"] = replace(
        agent.context.sandboxes.running["busy"], memory_share=None
    )
    ticks(agent, layer, clock, 1)
    [own] = [
        m["sandboxes"]["7"] for g, m in layer.sent if g == "host.h.sandbox.7" and m["type"] == "gpu.sample"
    ]
    assert own["util_pct"] == 55.0


def read_latest_sync() -> dict[str, dict[str, Any]]:
    import redis

    return read_latest(redis.Redis.from_url(settings.REDIS_URL))


# -- memory against the share ------------------------------------------------------------------


def over_share_sent(sent_tasks: list[Any]) -> list[tuple[int, str, int]]:
    return [
        (report["sandbox_id"], report["action"], report["mem_mib"])
        for _q, task, (_host, report) in [t for t in sent_tasks if t[1] == "sandbox_over_share"]
    ]


def test_a_sandbox_over_its_share_by_two_processes_is_warned_then_stopped_after_the_grace(
    fake: FakeNvml, nvml_agent: tuple[Agent, FakeLayer, dict[str, int]], sent_tasks: Any
) -> None:
    """Guards review-3 new #7 and §3: limits were per process (or none), so a sandbox with two
    processes held twice its grant and a time-slice replica could take the whole GPU."""
    agent, layer, clock = nvml_agent
    share = MemoryShare(
        kind="timeslice", memory_mib=20 * GIB, replicas=4, over_share=OVER_SHARE_STOP, grace_s=5
    )
    running = agent.context.sandboxes.running
    running["busy"] = replace(running["busy"], memory_share=share)
    each_half = [
        SimpleNamespace(pid=101, usedGpuMemory=12 * GIB * MIB),
        SimpleNamespace(pid=102, usedGpuMemory=12 * GIB * MIB),
    ]
    fake.h100.procs = [*each_half, SimpleNamespace(pid=202, usedGpuMemory=4 * GIB * MIB)]
    ticks(agent, layer, clock, 12)  # 24 GiB of a 20 GiB share; neither process alone is over
    assert over_share_sent(sent_tasks) == [(7, "warn", 24 * GIB), (7, "stop", 24 * GIB)]
    warn, stop = [t[2][1] for t in sent_tasks if t[1] == "sandbox_over_share"]
    assert warn["since_ms"] == stop["since_ms"] == 60_000 and stop["share_mib"] == 20 * GIB
    assert warn["gpu"] == H100_UUID and warn["allocation_key"] == "busy"
    # Its memory alert is against its share, not the GPU's 80 GiB (120 %: raised).
    raised = [t[2][1] for t in sent_tasks if t[1] == "telemetry_alerts"]
    assert any(c["sandbox"] == 7 and c["kind"] == "memory" for changes in raised for c in changes)
    fake.h100.procs = [each_half[0]]  # back within: cleared once it stays so for the hold
    ticks(agent, layer, clock, 12)
    assert over_share_sent(sent_tasks)[2:] == [(7, "clear", 12 * GIB)]


def test_a_warn_only_tier_is_never_stopped_and_a_gone_sandbox_is_forgotten() -> None:
    watch = ShareWatch()
    share = MemoryShare(kind="mps", memory_mib=1000, over_share="warn", grace_s=0)
    spec = timeslice_spec("a", 1, "GPU-x", share)
    actions = [r["action"] for t in range(0, 600_000, 1000) for r in watch.observe(spec, "GPU-x", 1500, t)]
    assert actions == ["warn"]
    watch.forget([])
    assert watch.over() == set()
    assert [r["action"] for r in watch.observe(spec, "GPU-x", 1500, 700_000)] == ["warn"]  # a new episode


def test_a_short_dip_under_the_share_neither_clears_nor_restarts_the_grace() -> None:
    watch = ShareWatch(clear_hold_s=10)
    share = MemoryShare(kind="timeslice", memory_mib=1000, replicas=2, over_share=OVER_SHARE_STOP, grace_s=30)
    spec = timeslice_spec("a", 1, "GPU-x", share)
    held = [1500] * 20 + [900] * 5 + [1500] * 20  # over 20 s, under 5 s, over again
    got = [
        (t, r["action"]) for t, mem in enumerate(held) for r in watch.observe(spec, "GPU-x", mem, t * 1000)
    ]
    assert got == [(0, "warn"), (30, "stop")]  # one warning; the stop 30 s after it first went over


def test_an_unsent_stop_is_sent_again() -> None:
    watch = ShareWatch()
    share = MemoryShare(kind="mps", memory_mib=1000, over_share=OVER_SHARE_STOP, grace_s=0)
    spec = timeslice_spec("a", 1, "GPU-x", share)
    _warn, stop = watch.observe(spec, "GPU-x", 2000, 0)
    watch.unsent(stop)
    assert [r["action"] for r in watch.observe(spec, "GPU-x", 2000, 1000)] == ["stop"]


def test_an_mps_share_is_watched_against_its_memory_share_too() -> None:
    watch = ShareWatch()
    spec = replace(
        timeslice_spec("m", 3, "GPU-x", MemoryShare(kind="mps", memory_mib=4096)),
        mps=MpsShare(pipe_dir="", thread_pct=25, memory_mib=4096),
    )
    assert [r["action"] for r in watch.observe(spec, "GPU-x", 3 * 4096, 0)] == ["warn"]  # 3 clients x limit
    assert (
        watch.observe(replace(spec, memory_share=None), "GPU-x", 3 * 4096, 1000) == []
    )  # no share, no watch


def test_simulated_tenants_on_one_time_sliced_gpu_busy_idle_and_over_their_share(
    tmp_path: Path, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The browser scenario's agent side: three batch sandboxes on one simulated GPU, their
    load chosen by their commands."""
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, SimulatedDriver(tmp_path / "state", "h"), tmp_path)
    agent.context.inventory.refresh()
    gpu = backend.list_gpus()[0].uuid
    share = MemoryShare(
        kind="timeslice", memory_mib=20 * GIB, replicas=4, over_share=OVER_SHARE_STOP, grace_s=3
    )
    for key, sandbox_id, command in [
        ("busy", 1, ("gpushare-sim-load", "util=90")),
        ("idle", 2, ("gpushare-sim-load", "util=0", "mem_mib=1024")),
        ("hog", 3, ("gpushare-sim-load", "util=5", f"mem_mib={30 * GIB}")),
    ]:
        agent.launch(replace(timeslice_spec(key, sandbox_id, gpu, share), command=command, real_gpu=False))
    clock = {"now": 60_000}
    monkeypatch.setattr(sampler_module, "now_ms", lambda: clock["now"])
    layer = FakeLayer()
    ticks(agent, layer, clock, 5)
    assert agent.context.utilization.over_window("busy") == (90.0, 4.0)
    assert agent.context.utilization.over_window("idle") == (0.0, 4.0)
    assert over_share_sent(sent_tasks) == [(3, "warn", 30 * GIB), (3, "stop", 30 * GIB)]


def test_a_sandbox_whose_processes_are_not_known_is_unmeasured_not_idle(
    fake: FakeNvml, nvml_agent: tuple[Agent, FakeLayer, dict[str, int]], sent_tasks: Any
) -> None:
    """Before the first report lists its pids, or on a driver that cannot list them, summing
    its processes would give 0 %: an idle reading culling would act on."""
    agent, layer, clock = nvml_agent
    agent.context.driver.pid_map["late"] = [303]  # type: ignore[attr-defined]
    running = agent.context.sandboxes.running
    running["late"] = timeslice_spec("late", 9, H100_UUID, running["idle"].memory_share)
    ticks(agent, layer, clock, 1, lambda _: fake.record_process_util(fake.h100, {303: 50}))
    assert agent.context.utilization.over_window("late") == (None, 0.0)
    agent.reports.refresh_pid_owners(agent.context.driver.list_owned())
    ticks(agent, layer, clock, 1, lambda _: fake.record_process_util(fake.h100, {303: 50}))
    assert agent.context.utilization.over_window("late") == (50.0, 1.0)
