"""The gpushare trace policy: stranded capacity, its tie-breaks, and the replay/CLI plumbing."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from scheduler.placement.fragmentation import Fragmentation
from scheduler.placement.workload import TypicalPod
from scheduler.research.gpushare_trace import (
    FILLER_MIN_SHARE,
    EventualWaste,
    GpusharePolicy,
    StrandedCapacity,
    scarcity_weights,
    undominated_models,
)
from scheduler.research.paper import PAPER_POLICIES
from scheduler.research.paper.base import ReplayContext
from scheduler.research.paper.cluster import Cluster
from scheduler.research.paper.fgd import FgdPolicy
from scheduler.research.replay import POLICIES, main, replay
from scheduler.research.trace import (
    NodeSpec,
    PodSpec,
    Workload,
    build_workload,
    load_nodes,
    load_pods,
)
from tests.scheduler.test_trace_replay import write_trace


def pod(cpu: int, milli: int = 1000, num: int = 1, models: tuple[str, ...] = ()) -> PodSpec:
    return PodSpec("p", cpu, 1024, num, milli if num else 0, models, "p")


def policies(nodes: list[NodeSpec], typical: list[TypicalPod]) -> tuple[Cluster, GpusharePolicy, FgdPolicy]:
    cluster = Cluster(nodes)
    ctx = ReplayContext(cluster, Fragmentation(typical), random.Random(0))
    return cluster, GpusharePolicy(ctx), FgdPolicy(ctx)


WHOLE_GPU = [TypicalPod(10000, 1000, 1, (), 1.0)]


def test_stranded_capacity_counts_cpu_and_share_copies() -> None:
    whole = StrandedCapacity(WHOLE_GPU, [1.0])
    assert whole.amount("G2", 40000, (1000,) * 4) == 0  # CPU for all four GPUs
    assert whole.amount("G2", 15000, (1000,) * 4) == 3000  # CPU for one: three GPUs stranded
    assert whole.amount("G2", 5000, (1000,) * 4) == 4000  # no CPU: everything
    share = StrandedCapacity([TypicalPod(1000, 470, 1, (), 1.0)], [1.0])
    assert share.amount("G2", 8000, (300, 1000, 1000)) == 2300 - 4 * 470  # two copies per GPU
    model_bound = StrandedCapacity([TypicalPod(1000, 1000, 1, ("T4",), 1.0)], [1.0])
    assert model_bound.amount("G2", 8000, (1000, 1000)) == 2000  # cannot use the model at all
    pairs = StrandedCapacity([TypicalPod(1000, 1000, 2, (), 1.0)], [1.0])
    assert pairs.amount("G2", 8000, (0, 500, 1000, 1000, 1000)) == 1500  # one pair of whole GPUs


def test_breaking_a_largest_node_costs_when_whole_node_pods_are_typical() -> None:
    nodes = [
        NodeSpec("g3", 128000, 786432, 8, "G3"),
        NodeSpec("g2", 96000, 393216, 8, "G2"),
        NodeSpec("a10", 128000, 1048576, 1, "A10"),
    ]
    assert undominated_models(nodes) == {"G3"}
    typical = [TypicalPod(1000, 1000, 8, (), 0.5), TypicalPod(1000, 1000, 1, (), 0.5)]
    stranded = StrandedCapacity(typical, [0.5, 0.5], {"G3"})
    seven = (0,) + (1000,) * 7
    assert stranded.amount("G3", 128000, (1000,) * 8) == 0
    assert stranded.amount("G2", 95000, seven) == 0.5 * 7000  # no room for the 8-GPU pod
    assert stranded.amount("G3", 127000, seven) == 0.5 * 7000 + 1.5 * 0.5 * 7000
    without = StrandedCapacity(typical[1:], [1.0], {"G3"})  # no whole-node pods: no cost
    assert without.amount("G3", 127000, seven) == 0


def test_rare_models_weigh_more() -> None:
    nodes = [NodeSpec("a", 64000, 262144, 8, "G2"), NodeSpec("b", 64000, 262144, 2, "T4")]
    typical = [
        TypicalPod(1000, 500, 1, (), 0.5),
        TypicalPod(1000, 500, 1, ("T4",), 0.25),
        TypicalPod(1000, 0, 0, (), 0.25),
    ]
    weights = scarcity_weights(typical, nodes)
    assert sum(weights) == pytest.approx(1)
    # T4 holds 2 of the 10 GPUs: x 25; CPU-only and unconstrained pods keep their probability.
    assert weights[1] / weights[0] == pytest.approx(0.25 * 25 / 0.5)
    assert weights[2] == pytest.approx(weights[0] / 2)


def test_fgd_ties_go_to_the_node_that_strands_less() -> None:
    # A CPU-only pod leaves both nodes able to run one more typical pod: FGD sees a tie.
    nodes = [NodeSpec("tight", 20000, 262144, 2, "G2"), NodeSpec("roomy", 40000, 262144, 2, "G2")]
    _, ours, fgd = policies(nodes, WHOLE_GPU)
    cpu_pod = pod(10000, num=0)
    assert fgd.score(0, cpu_pod) == fgd.score(1, cpu_pod)
    # On 'tight' it would strand a GPU (CPU for one copy, two GPUs); 'roomy' keeps both usable.
    assert ours.score(1, cpu_pod) > ours.score(0, cpu_pod)


def test_fgd_score_still_comes_first() -> None:
    nodes = [NodeSpec("a", 64000, 262144, 2, "G2"), NodeSpec("b", 64000, 262144, 2, "G2")]
    cluster, ours, fgd = policies(nodes, [TypicalPod(1000, 1000, 1, (), 1.0)])
    cluster.allocate(1, pod(1000, 600), (0,))  # b: one GPU with 400 left, one free
    share = pod(1000, 400)
    assert fgd.score(1, share) > fgd.score(0, share)  # filling the 400 leftover on b
    assert ours.score(1, share) > ours.score(0, share)
    assert ours.pick_gpus(1, share) == (0,)


def test_a_share_takes_the_gpu_that_strands_least() -> None:
    nodes = [NodeSpec("a", 64000, 262144, 3, "G2")]
    cluster, ours, _ = policies(nodes, [TypicalPod(1000, 500, 1, (), 1.0)])
    cluster.allocate(0, pod(1000, 500), (1,))  # free: 1000, 500, 1000
    assert ours.pick_gpus(0, pod(1000, 500)) == (1,)  # completes the half-used GPU
    assert ours.pick_gpus(0, pod(1000, 1000)) == (0,)  # whole GPUs: the lowest free index
    assert ours.pick_gpus(0, pod(1000, num=0)) == ()


SHARES = [
    TypicalPod(8000, 470, 1, (), 0.4),
    TypicalPod(4000, 320, 1, (), 0.2),
    TypicalPod(8000, 650, 1, (), 0.2),
    TypicalPod(12000, 1000, 1, (), 0.2),
]


def test_eventual_waste_fills_gaps_with_common_shares_that_fit_the_cpu() -> None:
    waste = EventualWaste(SHARES)
    assert waste.gpu("G2", 530, 96000) == 60  # one more 470
    assert waste.gpu("G2", 350, 96000) == 30  # a 320
    assert waste.gpu("G2", 210, 96000) == 210  # nothing common fits
    assert waste.gpu("G2", 1000, 96000) == 30  # 650 + 320 beats 470 + 470
    assert waste.gpu("G2", 530, 6000) == 210  # CPU for a 320 only
    assert waste.gpu("G2", 530, 3000) == 530  # CPU for nothing
    assert waste.amount("G2", 96000, (210, 530)) == 270


def test_rare_shares_are_not_fillers() -> None:
    rare = FILLER_MIN_SHARE / 2
    waste = EventualWaste([TypicalPod(4000, 810, 1, (), 1.0), TypicalPod(4000, 160, 1, (), rare)])
    assert waste.gpu("G2", 190, 96000) == 190  # a 190 gap does not count on the rare 160
    models = EventualWaste([TypicalPod(4000, 500, 1, ("T4",), 1.0)])
    assert models.gpu("G2", 1000, 96000) == 1000 and models.gpu("T4", 1000, 96000) == 0


def test_a_share_pairs_where_its_partner_can_follow() -> None:
    nodes = [NodeSpec(name, 96000, 393216, 1, "G2") for name in ("lone470", "lone650", "fresh")]
    cluster, ours, fgd = policies(nodes, SHARES)
    cluster.allocate(0, pod(8000, 470), (0,))  # 530 left: a 320 would leave 210, unfillable
    cluster.allocate(1, pod(8000, 650), (0,))  # 350 left: a 320 leaves 30
    share = pod(4000, 320)
    assert fgd.score(0, share) > fgd.score(2, share)  # FGD fills the lone 470
    assert ours.score(1, share) > ours.score(0, share) and ours.score(2, share) > ours.score(0, share)


@pytest.fixture
def workload(tmp_path: Path) -> Workload:
    nodes, pods = write_trace(tmp_path)
    return build_workload(load_nodes(nodes), load_pods(pods), 42, 1.3)


def test_registered_beside_the_paper_policies() -> None:
    assert POLICIES["gpushare"] is GpusharePolicy
    assert all(POLICIES[name] is factory for name, factory in PAPER_POLICIES.items())


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


def test_cli_runs_gpushare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = write_trace(tmp_path)
    out = tmp_path / "out"
    main(["--nodes", str(nodes), "--pods", str(pods), "--policy", "gpushare", "--out", str(out)])
    assert capsys.readouterr().out.startswith("gpushare seed 42:")
    with (out / "placements.csv").open() as f:
        placed = [row for row in csv.DictReader(f) if row["node"]]
    assert placed and all(row["node"] in {"n0", "n1", "n2", "n3"} for row in placed)
