"""The six FGD-paper policies: feasibility, integer scores, GPU picks, and F(n).

Expected values for GpuPacking and F(n) are the paper repository's unit-test values
(pkg/simulator/plugin/gpu_packing_score_test.go, pkg/utils/frag_test.go), on the same
node and pod inputs.
"""

from __future__ import annotations

import random

import pytest

from scheduler.placement.fragmentation import Fragmentation
from scheduler.placement.workload import TypicalPod
from scheduler.research.paper import PAPER_POLICIES
from scheduler.research.paper.base import ReplayContext
from scheduler.research.paper.baselines import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProdPolicy,
    packing_score,
)
from scheduler.research.paper.cluster import Cluster, best_fit_gpu, exclusive_gpus, gpu_fits
from scheduler.research.paper.fgd import FgdPolicy, sigmoid_score
from scheduler.research.trace import NodeSpec, PodSpec


def pod(
    cpu: int = 1000, milli: int = 1000, num: int = 1, models: tuple[str, ...] = (), mem: int = 1024
) -> PodSpec:
    return PodSpec("p", cpu, mem, num, milli if num else 0, models, "p")


def typical(rows: list[tuple[int, int, int, str, float]]) -> list[TypicalPod]:
    """Percentages as the Go tests give them (not renormalised)."""
    return [
        TypicalPod(cpu, milli, num, (model,) if model else (), pct / 100)
        for cpu, milli, num, model, pct in rows
    ]


# TestingGenerateGetTypicalPods: (MilliCpu, MilliGpu, GpuNumber, GpuType, %).
GPU_TYPICAL = typical(
    [
        (6000, 465, 1, "", 9.33), (8000, 440, 1, "2080", 9.15), (8000, 475, 1, "T4", 8.76),
        (8000, 440, 1, "P100", 8.72), (2000, 465, 1, "", 8.68), (12000, 900, 1, "", 8.65),
        (4000, 900, 1, "", 8.43), (16000, 678, 1, "T4", 8.36), (8000, 500, 1, "", 8.29),
        (6000, 511, 1, "", 8.11), (14000, 1000, 2, "2080", 0.54), (4000, 1000, 1, "2080", 0.43),
        (32000, 1000, 2, "T4", 0.43), (16000, 1000, 1, "V100M16", 0.40), (64000, 1000, 2, "", 0.40),
        (10000, 1000, 2, "", 0.40), (11400, 1000, 1, "T4", 0.36), (16000, 1000, 1, "T4", 0.36),
        (4000, 1000, 2, "", 0.36), (14000, 1000, 2, "V100M16", 0.36), (8000, 1000, 4, "", 0.36),
        (16000, 1000, 2, "", 0.32), (2000, 1000, 1, "T4", 0.32), (6000, 1000, 1, "", 0.32),
        (4000, 1000, 1, "", 0.32), (5000, 1000, 1, "", 0.32), (32000, 1000, 4, "V100M16", 0.32),
        (32000, 1000, 2, "", 0.32), (24000, 1000, 8, "2080", 0.32), (40000, 1000, 4, "", 0.29),
        (32000, 1000, 8, "", 0.29), (32000, 1000, 1, "T4", 0.29), (16000, 1000, 1, "", 0.25),
        (7000, 1000, 1, "V100M16", 0.25), (24000, 1000, 1, "T4", 0.25),
    ]
)  # fmt: skip

# TestingGenerateGetTypicalPodsWithNonGpu.
MIXED_TYPICAL = typical(
    [
        (15700, 1000, 1, "", 28.69), (11900, 1000, 1, "", 18.93), (11400, 1000, 1, "", 12.27),
        (1000, 0, 0, "", 7.36), (18710, 1000, 1, "", 4.85), (8200, 1000, 1, "", 3.79),
        (16400, 1000, 1, "", 3.31), (9810, 1000, 1, "", 1.97), (15200, 1000, 1, "", 1.87),
        (11200, 1000, 1, "", 1.81), (14200, 1000, 1, "", 1.76), (12000, 0, 0, "", 1.65),
        (14900, 1000, 1, "", 1.39), (60200, 1000, 4, "", 1.23), (64200, 1000, 8, "", 1.07),
        (32200, 1000, 4, "", 1.01), (17400, 1000, 2, "", 0.91), (30200, 1000, 2, "", 0.69),
        (16000, 1000, 1, "", 0.64), (15000, 1000, 1, "", 0.59), (64000, 1000, 8, "", 0.53),
        (15000, 0, 0, "", 0.53), (11910, 1000, 1, "", 0.53), (120200, 1000, 8, "", 0.48),
        (11300, 1000, 1, "", 0.37), (30000, 1000, 2, "", 0.32), (9800, 1000, 1, "", 0.32),
        (8000, 1000, 1, "", 0.32), (2000, 1000, 1, "", 0.27), (2000, 80, 1, "", 0.27),
        (1000, 1000, 1, "", 0.27),
    ]
)  # fmt: skip


def frag_of(typical_pods: list[TypicalPod], model: str, cpu: int, free: list[int]) -> float:
    return Fragmentation(typical_pods).amount(model, cpu, tuple(sorted(free)))


@pytest.mark.parametrize(
    ("typical_pods", "model", "cpu", "free", "expected"),
    [
        (GPU_TYPICAL, "1080", 1000, [200, 1000, 1000, 500], 2566.62),
        (GPU_TYPICAL, "1080", 1000, [1000] * 4, 3802.40),
        (GPU_TYPICAL, "1080", 1000, [1000] * 8, 7604.80),
        (GPU_TYPICAL[:1], "1080", 1000, [200, 1000, 1000, 500], 251.91),
        (MIXED_TYPICAL, "P100", 64000, [1000] * 8, 887.20),
        (MIXED_TYPICAL, "P100", 32000, [1000] * 4 + [0] * 4, 554.4),
        (MIXED_TYPICAL, "P100", 0, [1000] * 4 + [0] * 4, 4000),
    ],
)
def test_fragmentation_matches_the_papers_unit_vectors(
    typical_pods: list[TypicalPod], model: str, cpu: int, free: list[int], expected: float
) -> None:
    assert frag_of(typical_pods, model, cpu, free) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(
    ("free", "shape", "expected"),
    [
        ([200, 1000, 1000, 500], pod(100, 1000, 2), 48),  # has to open idle GPUs on a used node
        ([1000] * 4, pod(100, 1000, 2), 29),  # idle node: 33 - 4 GPUs
        ([1000] * 8, pod(100, 1000, 2), 25),
        ([200, 1000, 1000, 500], pod(100, 200, 2), 93),  # fits on shared GPUs (20 + 50) / 10
    ],
)
def test_packing_scores_match_the_papers_unit_values(free: list[int], shape: PodSpec, expected: int) -> None:
    assert packing_score(free, shape) == expected


def context(*nodes: NodeSpec, typical_pods: list[TypicalPod] | None = None) -> ReplayContext:
    cluster = Cluster(list(nodes))
    return ReplayContext(cluster, Fragmentation(typical_pods or GPU_TYPICAL), random.Random(0))


def test_feasibility_checks_cpu_memory_model_and_per_gpu_milli() -> None:
    ctx = context(NodeSpec("a", 8000, 16384, 2, "T4"))
    cluster = ctx.cluster
    assert cluster.fits(0, pod(8000, 500, mem=16384))
    assert not cluster.fits(0, pod(8001, 500))
    assert not cluster.fits(0, pod(1000, 500, mem=16385))
    assert cluster.fits(0, pod(1000, 500, models=("V100M16", "T4")))
    assert not cluster.fits(0, pod(1000, 500, models=("V100M16",)))
    assert not cluster.fits(0, pod(1000, 1000, num=3))
    cluster.allocate(0, pod(1000, 600), (1,))
    assert cluster.fits(0, pod(1000, 400)) and not cluster.fits(0, pod(1000, 1000, num=2))
    assert not cluster.fits(0, pod(7001, 0, num=0))  # CPU-only pods still need CPU
    assert gpu_fits("T4", [0, 0], pod(1000, 0, num=0))  # and skip the GPU filter entirely
    cluster.pod_count[0] = 1001
    assert not cluster.fits(0, pod(100, 0, num=0))


def test_gpu_selection() -> None:
    assert best_fit_gpu([1000, 300, 500, 300], 300) == 1  # tightest, lowest index on ties
    assert best_fit_gpu([1000, 200, 500], 300) == 2
    assert exclusive_gpus([400, 1000, 1000, 1000], pod(1000, 1000, 2)) == (1, 2)


def test_dotprod_and_bestfit_scores() -> None:
    ctx = context(NodeSpec("a", 64000, 262144, 8, "G2"))
    request = pod(32000, 1000, 4)
    # d = (0.5 * 0.25 + 1.0 * 0.5) / 2 = 0.3125
    assert DotProdPolicy(ctx).score(0, request) == 68
    # raw = 0.5 * 32000/128000 + 0.5 * 4000/8000 = 0.375
    assert BestFitPolicy(ctx).score(0, request) == 62
    ctx.cluster.cpu_left[0] = 1000
    assert DotProdPolicy(ctx).score(0, request) == 0  # CPU short


def test_clustering_scores_by_tags() -> None:
    ctx = context(NodeSpec("a", 64000, 262144, 4, "T4"))
    policy, share, whole = ClusteringPolicy(ctx), pod(1000, 500), pod(1000, 1000)
    assert policy.score(0, share) == 25 * 4000 // 8000 + 25  # no GPU pods yet
    ctx.cluster.allocate(0, share, (0,))
    assert policy.score(0, share) == 25 * 4500 // 8000 + 75  # only its own tag
    assert policy.score(0, whole) == 25 * 4500 // 8000  # only other tags
    ctx.cluster.allocate(0, whole, (1,))
    assert policy.score(0, share) == 25 * 5500 // 8000 + 50
    assert policy.score(0, pod(1000, 0, num=0)) == 0


def test_fgd_scores_and_picks_the_first_best_gpu() -> None:
    assert sigmoid_score(0.0) == 50
    assert sigmoid_score(-1e-9) == 49  # truncation, not rounding
    ctx = context(NodeSpec("a", 64000, 262144, 4, "1080"))
    fgd = FgdPolicy(ctx)
    ctx.cluster.allocate(0, pod(1000, 465), (2,))  # free: 1000, 1000, 535, 1000
    share = pod(6000, 465)
    # A 465 share fits exactly into GPU 2's 535 leaving 70; that lowers F the most.
    assert fgd.pick_gpus(0, share) == (2,)
    before = ctx.frag.amount("1080", 63000, (535, 1000, 1000, 1000))
    after = ctx.frag.amount("1080", 57000, (70, 1000, 1000, 1000))
    assert fgd.score(0, share) == sigmoid_score(before - after)
    assert fgd.pick_gpus(0, pod(1000, 1000, 2)) == (0, 1)
    assert fgd.score(0, pod(1000, 0, num=0)) <= 50  # CPU-only pods can only add fragmentation


def test_every_policy_scores_within_range() -> None:
    for name, factory in PAPER_POLICIES.items():
        ctx = context(NodeSpec("a", 96000, 393216, 8, "G2"))
        policy = factory(ctx)
        assert policy.name == name
        for request in (pod(4000, 300), pod(8000, 1000, 2), pod(2000, 0, num=0)):
            assert 0 <= policy.score(0, request) <= 100
            gpus = policy.pick_gpus(0, request)
            assert len(gpus) == (request.num_gpu if request.gpu_milli else 0)
