"""The portal's placement policy, gpushare, on the live model: how it ranks, what it learns,
and that the trace replays drive exactly it."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from scheduler.cluster import (
    AUTO,
    CPU_ONLY,
    DEDICATED,
    MIG,
    MPS,
    TIMESLICE,
    GpuState,
    HostState,
    Place,
    Request,
    Snapshot,
    book,
)
from scheduler.placement import get_policy
from scheduler.placement.gpushare import PRIOR, GpusharePolicy
from scheduler.placement.workload import MIN_OBSERVED, TypicalPod, WorkloadModel, observed_shape
from scheduler.research.live_replay import mirror_snapshot, pod_request, replay_live, replay_offline
from scheduler.research.paper.cluster import Cluster
from scheduler.research.replay import main, replay
from scheduler.research.trace import NodeSpec, PodSpec, Workload, build_workload, load_nodes, load_pods
from tests.scheduler.test_trace_replay import write_trace

SHARES = [
    TypicalPod(8000, 470, 1, (), 0.4),
    TypicalPod(4000, 320, 1, (), 0.2),
    TypicalPod(8000, 650, 1, (), 0.2),
    TypicalPod(12000, 1000, 1, (), 0.2),
]


def knowing(typical: list[TypicalPod]) -> GpusharePolicy:
    """A policy whose workload model has published ``typical``."""
    model = WorkloadModel()
    model.typical, model.version = typical, 1
    return GpusharePolicy(model)


def fleet(*nodes: tuple[str, int, int, str]) -> Snapshot:
    return mirror_snapshot([NodeSpec(name, cpu, 1 << 20, gpus, model) for name, cpu, gpus, model in nodes])


def share(milli: int, cpu: int = 1000, rid: int = 1) -> Request:
    return Request(rid, "p", 0, 0.0, MPS, mps_thread_pct=milli // 10, cpu_milli=cpu)


def whole(gpus: int = 1, cpu: int = 1000, rid: int = 1) -> Request:
    return Request(rid, "p", 0, 0.0, DEDICATED, gpu_count=gpus, cpu_milli=cpu)


def cpu_only(cpu: int, rid: int = 1) -> Request:
    return Request(rid, "p", 0, 0.0, CPU_ONLY, cpu_milli=cpu)


def take(snapshot: Snapshot, host: str, index: int, milli: int, cpu: int = 1000) -> None:
    """Put an MPS share of ``milli`` on one GPU, as a placement would."""
    h = next(h for h in snapshot.hosts if h.name == host)
    h.gpus[index].mps_used_threads += milli // 10
    h.take(cpu, 0)
    snapshot.changed(host)


def placed(policy: GpusharePolicy, snapshot: Snapshot, request: Request) -> Place:
    decision = policy.place(snapshot, request)
    assert isinstance(decision, Place), decision
    return decision


def test_ties_in_fgd_go_to_the_host_that_strands_less() -> None:
    # A CPU-only request leaves both hosts able to run one more typical pod: FGD sees a tie.
    # On 'tight' it would strand a GPU (CPU for one copy, two GPUs); 'roomy' keeps both usable.
    # ('big', the largest host, is kept whole either way: without it 'roomy' would be the
    # largest, and keeping that whole for multi-GPU requests ranks with FGD's score.)
    snapshot = fleet(("tight", 20000, 2, "G2"), ("roomy", 40000, 2, "G2"), ("big", 96000, 8, "G2"))
    assert placed(knowing([TypicalPod(10000, 1000, 1, (), 1.0)]), snapshot, cpu_only(10000)).host == "roomy"


def test_a_share_fills_a_partly_used_gpu() -> None:
    snapshot = fleet(("a", 64000, 2, "G2"), ("b", 64000, 2, "G2"))
    take(snapshot, "b", 0, 600)  # b: one GPU with 400 left, one idle
    decision = placed(knowing([TypicalPod(1000, 1000, 1, (), 1.0)]), snapshot, share(400))
    assert (decision.host, decision.grants[0].gpu_uuid) == ("b", "b-gpu0")
    assert decision.grants[0].kind == "mps" and decision.grants[0].mps_thread_pct == 40


def test_a_share_pairs_where_its_partner_can_follow() -> None:
    snapshot = fleet(("lone470", 96000, 1, "G2"), ("lone650", 96000, 1, "G2"), ("fresh", 96000, 1, "G2"))
    take(snapshot, "lone470", 0, 470, 8000)  # 530 left: a 320 would leave 210, unfillable
    take(snapshot, "lone650", 0, 650, 8000)  # 350 left: a 320 leaves 30
    assert placed(knowing(SHARES), snapshot, share(320, 4000)).host == "lone650"


def test_whole_gpus_and_cpu_only_requests_stay_off_the_largest_hosts_before_any_multi_gpu_request() -> None:
    # Nothing learnt yet: the largest host (most CPU and GPUs) is kept whole all the same.
    snapshot = fleet(("g2", 96000, 8, "G2"), ("g3", 128000, 8, "G3"))
    policy = GpusharePolicy()
    assert policy.workload.typical == []
    assert placed(policy, snapshot, whole(cpu=11300)).host == "g2"
    assert placed(policy, snapshot, cpu_only(12500)).host == "g2"


def test_small_requests_keep_off_the_host_a_learnt_multi_gpu_request_needs() -> None:
    # The cpu250 trace's failure in small: 8-GPU requests of 88 cores are a third of the GPU
    # demand but too rare to be typical. A CPU-only request of 32 cores on 'pair' leaves it
    # too little CPU for a typical single GPU, which FGD's score sees; on 'eight' it strands
    # nothing typical. Ranked below FGD's score the whole node's cost never decided, the
    # request took 'eight' and the 8-GPU request then fitted nowhere.
    snapshot = fleet(("eight", 96000, 8, "G2"), ("pair", 40000, 2, "T4"))
    policy = knowing([TypicalPod(12000, 1000, 1, (), 1.0)])
    policy.workload.multi_gpu_share = 0.3
    policy.workload.multi_gpu = [TypicalPod(88000, 1000, 8, (), 1.0)]
    small = placed(policy, snapshot, cpu_only(32000))
    assert small.host == "pair"
    next(h for h in snapshot.hosts if h.name == "pair").take(32000, 0)
    snapshot.changed("pair")
    assert placed(policy, snapshot, whole(gpus=8, cpu=88000, rid=2)).host == "eight"


def test_the_model_keeps_every_multi_gpu_shape_by_its_part_of_their_demand() -> None:
    model = WorkloadModel()
    for key in range(MIN_OBSERVED):
        shape = (
            (4000, 470, 1, ()) if key % 50 else ((88000, 1000, 8, ()) if key % 100 else (16000, 1000, 2, ()))
        )
        model.observe(key, shape)
    # Two of 200 requests each: neither is typical, both are kept, by the GPUs they ask for.
    assert all(t.num_gpu == 1 for t in model.typical)
    assert {(t.num_gpu, round(t.probability, 3)) for t in model.multi_gpu} == {(8, 0.8), (2, 0.2)}


def test_an_idle_gpu_following_demand_takes_any_mode_and_a_used_one_only_its_own() -> None:
    snapshot = fleet(("a", 64000, 1, "G2"))
    policy = knowing(PRIOR)
    gpu = snapshot.hosts[0].gpus[0]
    assert gpu.mode == AUTO and gpu.serves(DEDICATED) and gpu.serves(MPS)
    book(gpu, placed(policy, snapshot, share(300)).grants[0])
    snapshot.changed("a")
    assert not isinstance(policy.place(snapshot, whole()), Place)  # holds an MPS share now
    assert isinstance(policy.place(snapshot, share(300, rid=2)), Place)


def test_what_it_knows_of_the_workload_comes_from_what_it_was_shown() -> None:
    model = WorkloadModel()
    for key in range(MIN_OBSERVED - 1):
        model.observe(key, (4000, 470, 1, ()) if key % 2 else (12000, 1000, 1, ()))
    # Too few to tell the typical requests from chance: nothing published, the policy packs.
    assert model.typical == [] and model.version == 0
    model.observe(3, (1, 1, 8, ()))  # seen before: ignored
    assert model.observed == MIN_OBSERVED - 1
    assert model.observe(MIN_OBSERVED, (12000, 1000, 1, ())) is True
    assert {(t.cpu_milli, t.gpu_milli) for t in model.typical} == {(4000, 470), (12000, 1000)}
    assert model.observed == MIN_OBSERVED and model.multi_gpu_share == 0.0


def test_live_requests_are_counted_in_the_shape_of_the_traces_pods() -> None:
    def live(mode: str, **kw: Any) -> Request:
        return Request(id=0, project="p", priority=0, submitted_at=0.0, mode=mode, cpu_milli=2000, **kw)

    assert observed_shape(live(DEDICATED, gpu_count=2)) == (2000, 1000, 2, ())
    assert observed_shape(live(MPS, mps_thread_pct=25)) == (2000, 250, 1, ())
    assert observed_shape(live(TIMESLICE)) == (2000, 250, 1, ())
    assert observed_shape(live(CPU_ONLY)) == (2000, 0, 0, ())
    assert observed_shape(live(MIG, mig_profile="1g.10gb")) is None
    # The same shape the trace's pod has, once the pod is the request the portal would make.
    pod = PodSpec("p", 4000, 2048, 1, 470, ("T4",), "p")
    assert observed_shape(pod_request(0, pod)) == pod.shape


def test_a_mirror_takes_another_models_publication_and_versions_only_changes() -> None:
    source = WorkloadModel()
    for key in range(MIN_OBSERVED):
        source.observe(key, (4000, 470, 1, ()) if key % 4 else (8000, 1000, 2, ()))
    assert source.typical
    mirror = WorkloadModel()
    mirror.adopt(source.typical, source.multi_gpu_share, source.multi_gpu)
    assert (mirror.typical, mirror.multi_gpu_share, mirror.multi_gpu, mirror.version) == (
        source.typical,
        source.multi_gpu_share,
        source.multi_gpu,
        1,
    )
    # the same publication again
    mirror.adopt(list(source.typical), source.multi_gpu_share, list(source.multi_gpu))
    assert mirror.version == 1


@pytest.fixture
def workload(tmp_path: Path) -> Workload:
    nodes, pods = write_trace(tmp_path)
    return build_workload(load_nodes(nodes), load_pods(pods), 42, 1.3)


def test_the_replays_run_the_portals_default_policy() -> None:
    assert isinstance(get_policy("gpushare"), GpusharePolicy)


def test_every_placement_is_feasible_and_replays_repeat(workload: Workload) -> None:
    result = replay(workload, "gpushare")
    assert 0 < result.failed < len(workload.pods)
    cluster = Cluster(workload.nodes)
    for p, n, gpus in zip(workload.pods, result.node, result.gpus, strict=True):
        if n < 0:
            assert not any(cluster.fits(m, p) for m in range(len(workload.nodes)))
            continue
        assert cluster.fits(n, p)
        assert len(gpus) == p.num_gpu and all(cluster.free[n][g] >= p.gpu_milli for g in gpus)
        cluster.allocate(n, p, gpus)
    again = replay(workload, "gpushare")
    assert (result.node, result.gpus) == (again.node, again.gpus)


def test_one_arrival_per_cycle_places_exactly_as_the_policy_alone(workload: Workload) -> None:
    offline = replay_offline(workload)
    live = replay_live(workload, batch=1)
    assert (live.node, live.gpus) == (offline.node, offline.gpus)
    assert live.used_milli == offline.used_milli


def test_pods_become_the_requests_the_portal_would_make() -> None:
    def pod(num: int, milli: int) -> PodSpec:
        return PodSpec("p", 4000, 2048, num, milli, ("T4",), "p")

    shared, two, none = pod_request(0, pod(1, 470)), pod_request(1, pod(2, 1000)), pod_request(2, pod(0, 0))
    assert (shared.mode, shared.mps_thread_pct, shared.gpu_models) == (MPS, 47, ("T4",))
    assert (two.mode, two.gpu_count) == (DEDICATED, 2)
    assert none.mode == CPU_ONLY and (none.cpu_milli, none.memory_mib) == (4000, 2048)


def test_cli_live_engine_writes_the_same_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = write_trace(tmp_path)
    out = tmp_path / "out"
    main(["--engine", "live", "--nodes", str(nodes), "--pods", str(pods), "--batch", "7", "--out", str(out)])
    assert capsys.readouterr().out.startswith("gpushare (live, batch 7) seed 42:")
    with (out / "placements.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["seq", "pod", "source", "node", "gpus", "milli_per_gpu"]
    assert any(row["node"] for row in rows) and all(
        row["node"] in {"", "n0", "n1", "n2", "n3"} for row in rows
    )
    assert (out / "curve.csv").exists()


def test_cli_refuses_another_policy_on_the_live_engine(tmp_path: Path) -> None:
    nodes, pods = write_trace(tmp_path)
    with pytest.raises(SystemExit):
        main(
            ["--engine", "live", "--policy", "fgd", "--nodes", str(nodes), "--pods", str(pods), "--out", "x"]
        )


def test_a_host_without_cpu_tracking_is_never_short_of_it() -> None:
    host = HostState("h", True, [GpuState("g", "h", 0, "G2", 20000, AUTO)])
    assert placed(knowing(PRIOR), Snapshot([host]), whole(cpu=500_000)).host == "h"


def test_a_cpu_only_request_waits_for_cpu_or_preempts_for_it() -> None:
    from scheduler.cluster import Pending, Preempt, Running
    from scheduler.cycle import run_cycle

    snapshot = fleet(("a", 8000, 1, "G2"))
    snapshot.hosts[0].take(6000, 0)
    low = Running(7, "p", "a", (), priority=0, preemptible=True, cpu_milli=6000)
    decisions = run_cycle(snapshot, [cpu_only(4000)], get_policy("gpushare"), 0.0)
    assert isinstance(decisions[0], Pending) and "CPU cores" in decisions[0].reason
    snapshot.running = [low]
    urgent = Request(2, "p", 10, 0.0, CPU_ONLY, cpu_milli=4000)
    decisions = run_cycle(snapshot, [urgent], get_policy("gpushare"), 0.0)
    assert isinstance(decisions[0], Preempt) and decisions[0].sandbox_id == 7
    assert isinstance(decisions[1], Place) and decisions[1].grants == ()
