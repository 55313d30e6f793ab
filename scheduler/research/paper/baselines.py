"""The paper's five baselines: Random, DotProd, GpuClustering, GpuPacking and BestFit.

Scores are the plugins' integers, truncated where Go truncates: the ties that truncation
creates are decided by node priority and shape the results.
"""

from __future__ import annotations

from scheduler.placement.workload import MILLI
from scheduler.research.paper.base import BestGpu, ReplayContext
from scheduler.research.paper.cluster import affinity_tag, exclusive_gpus, random_gpu
from scheduler.research.trace import PodSpec

# The paper normalises by the largest node spec, not by each node's own capacity.
MAX_SPEC_CPU = 128000
MAX_SPEC_GPU = 8000


class RandomPolicy:
    """A uniformly random feasible node, and a random GPU among those that fit."""

    name = "random"
    random_node = True

    def __init__(self, ctx: ReplayContext) -> None:
        self.cluster = ctx.cluster
        self.rng = ctx.rng

    def score(self, n: int, pod: PodSpec) -> int:
        return 0

    def pick_gpus(self, n: int, pod: PodSpec) -> tuple[int, ...]:
        free = self.cluster.free[n]
        if pod.gpu_milli <= 0:
            return ()
        if pod.sharing:
            return (random_gpu(free, pod.gpu_milli, self.rng),)
        return exclusive_gpus(free, pod)


class DotProdPolicy(BestGpu):
    """Tetris' alignment: prefer nodes whose free (CPU, GPU) vector is least aligned with the pod's."""

    name = "dotprod"
    random_node = False

    def score(self, n: int, pod: PodSpec) -> int:
        cpu_left = self.cluster.cpu_left[n]
        if cpu_left < pod.cpu_milli:
            return 0
        gpu_left = self.cluster.gpu_free_total(n)
        dot = (cpu_left / MAX_SPEC_CPU) * (pod.cpu_milli / MAX_SPEC_CPU) + (gpu_left / MAX_SPEC_GPU) * (
            pod.total_gpu_milli / MAX_SPEC_GPU
        )
        return int(100 * (1 - dot / 2))


class ClusteringPolicy(BestGpu):
    """GpuClustering: keep pods of one GPU shape together, fuller nodes first."""

    name = "clustering"
    random_node = False

    def score(self, n: int, pod: PodSpec) -> int:
        if pod.gpu_milli <= 0:
            return 0
        base = 25 * (MAX_SPEC_GPU - self.cluster.gpu_free_total(n)) // MAX_SPEC_GPU
        tags = self.cluster.tags[n]
        tag = affinity_tag(pod)
        if tag in tags:
            return base + (75 if len(tags) == 1 else 50)
        return base + (25 if not tags else 0)


class PackingPolicy(BestGpu):
    """GpuPacking: shared GPUs first, then partly used nodes, then the smallest idle nodes."""

    name = "packing"
    random_node = False

    def score(self, n: int, pod: PodSpec) -> int:
        if pod.gpu_milli <= 0:
            return 0
        return packing_score(self.cluster.free[n], pod)


def packing_score(free: list[int], pod: PodSpec) -> int:
    gpus = len(free)
    if all(f == MILLI for f in free):
        return max(33 - gpus, gpus)
    taken = [f for f in sorted(free) if f >= pod.gpu_milli][: pod.num_gpu]
    idle_taken = sum(1 for f in taken if f == MILLI)
    if idle_taken:
        return max(50 - idle_taken, 33)
    used = sum(f * 100 // MILLI for f in taken)
    return max(100 - used // 10, 50)


class BestFitPolicy(BestGpu):
    """The node left with the least weighted free CPU and GPU after placement.

    The paper min-max normalises the scores over the feasible nodes with integer
    division; only the maximum maps to 100, so the raw maximum wins and its ties go to
    node priority, as here.
    """

    name = "bestfit"
    random_node = False

    def score(self, n: int, pod: PodSpec) -> int:
        cpu_left = self.cluster.cpu_left[n]
        gpu_left = self.cluster.gpu_free_total(n)
        raw = 0.0
        raw += (cpu_left - pod.cpu_milli) / MAX_SPEC_CPU * 0.5
        raw += (gpu_left - pod.total_gpu_milli) / MAX_SPEC_GPU * 0.5
        return int((1.0 - raw) * 100)
