"""The replayed cluster: what each node has left, and the paper's filter and GPU picks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scheduler.placement.workload import MILLI, accessible
from scheduler.research.trace import NodeSpec, PodSpec

MAX_PODS = 1001  # the paper's nodes advertise this many pod slots


def affinity_tag(pod: PodSpec) -> str:
    """GpuClustering's pod class: part of one GPU, k whole GPUs, or none."""
    if pod.num_gpu == 0 or pod.gpu_milli == 0:
        return "no-gpu"
    if pod.sharing:
        return "share-gpu"
    return f"{pod.num_gpu}-gpu"


@dataclass
class Cluster:
    """Per-node free resources as parallel lists, indexed like the name-sorted nodes."""

    nodes: list[NodeSpec]
    cpu_left: list[int] = field(init=False)
    mem_left: list[int] = field(init=False)
    pod_count: list[int] = field(init=False)
    free: list[list[int]] = field(init=False)  # per node, free milli of each GPU by index
    tags: list[dict[str, int]] = field(init=False)  # per node, affinity tags of its GPU pods

    def __post_init__(self) -> None:
        self.cpu_left = [n.cpu_milli for n in self.nodes]
        self.mem_left = [n.memory_mib for n in self.nodes]
        self.pod_count = [0] * len(self.nodes)
        self.free = [[MILLI] * n.gpus for n in self.nodes]
        self.tags = [{} for _ in self.nodes]

    def gpu_free_total(self, n: int) -> int:
        return sum(self.free[n])

    def fits(self, n: int, pod: PodSpec) -> bool:
        """The paper's filters: k8s NodeResourcesFit (CPU, memory, pod slots) and GPU share."""
        if self.cpu_left[n] < pod.cpu_milli or self.mem_left[n] < pod.memory_mib:
            return False
        if self.pod_count[n] >= MAX_PODS:
            return False
        return gpu_fits(self.nodes[n].model, self.free[n], pod)

    def allocate(self, n: int, pod: PodSpec, gpus: tuple[int, ...]) -> None:
        self.cpu_left[n] -= pod.cpu_milli
        self.mem_left[n] -= pod.memory_mib
        self.pod_count[n] += 1
        for g in gpus:
            self.free[n][g] -= pod.gpu_milli
        if gpus:
            tag = affinity_tag(pod)
            self.tags[n][tag] = self.tags[n].get(tag, 0) + 1


def gpu_fits(model: str, free: list[int], pod: PodSpec) -> bool:
    """Open-Gpu-Share's filter; pods without GPU milli skip it entirely."""
    if pod.gpu_milli <= 0:
        return True
    if not free or not accessible(model, pod.models):
        return False
    milli = pod.gpu_milli
    return sum(1 for f in free if f >= milli) >= pod.num_gpu


def exclusive_gpus(free: list[int], pod: PodSpec) -> tuple[int, ...]:
    """Whole-GPU pods take the lowest-indexed GPUs that can hold them (fully free ones)."""
    return tuple([g for g, f in enumerate(free) if f >= pod.gpu_milli][: pod.num_gpu])


def best_fit_gpu(free: list[int], milli: int) -> int:
    """The tightest GPU that fits; the strict comparison leaves ties to the lowest index."""
    best = -1
    for g, f in enumerate(free):
        if f >= milli and (best < 0 or f < free[best]):
            best = g
    return best


def random_gpu(free: list[int], milli: int, rng: random.Random) -> int:
    """A uniformly random GPU among those that fit (the paper uses reservoir sampling)."""
    fitting = [g for g, f in enumerate(free) if f >= milli]
    return fitting[rng.randrange(len(fitting))]


def sharing_outcomes(free_sorted: tuple[int, ...], pod: PodSpec) -> list[tuple[int, list[int]]]:
    """For a sharing pod: (position, free milli after) for each GPU it could take.

    Equal free values give equal hypothetical nodes, so each value is tried once, at its
    first (lowest) position.
    """
    outcomes, seen = [], -1
    for g, f in enumerate(free_sorted):
        if f >= pod.gpu_milli and f != seen:
            after = list(free_sorted)
            after[g] -= pod.gpu_milli
            outcomes.append((g, after))
            seen = f
    return outcomes


def exclusive_outcome(free_sorted: tuple[int, ...], pod: PodSpec) -> list[int]:
    """Free milli after a whole-GPU (or CPU-only) pod, as FGD's NodeResource.Sub takes GPUs:
    the first ``num_gpu`` that fit, in ascending order of free milli."""
    after = list(free_sorted)
    if pod.gpu_milli > 0:
        for g in [g for g, f in enumerate(after) if f >= pod.gpu_milli][: pod.num_gpu]:
            after[g] -= pod.gpu_milli
    return after
