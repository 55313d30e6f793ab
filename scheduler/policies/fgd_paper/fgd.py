"""FGD: place each pod where it grows the node's fragmentation F(n) the least.

Score = trunc(100 x sigmoid((F(before) - F(after)) / 1000)). A sharing pod is tried on
every GPU that fits, the node scoring its best GPU; other pods take the lowest free GPUs.
Scores depend on (model, CPU left, free GPUs as a multiset, pod shape) only, and nodes
in a large cluster repeat those states, so they are memoised on that key.
"""

from __future__ import annotations

import math

from scheduler.policies.fgd_paper.base import ReplayContext
from scheduler.policies.fgd_paper.cluster import exclusive_gpus
from scheduler.trace import PodSpec

_ScoreKey = tuple[str, int, tuple[int, ...], tuple[int, int, int, str]]


def sigmoid_score(delta: float) -> int:
    return int(1.0 / (1.0 + math.exp(-delta / 1000)) * 100)


class FgdPolicy:
    name = "fgd"
    random_node = False

    def __init__(self, ctx: ReplayContext) -> None:
        self.cluster = ctx.cluster
        self.frag = ctx.frag
        self._memo: dict[_ScoreKey, int] = {}

    def _gpu_score(
        self, model: str, cpu_after: int, free_sorted: tuple[int, ...], g: int, pod: PodSpec
    ) -> int:
        """Score of putting a sharing pod on the GPU at position ``g`` of the sorted list."""
        after = list(free_sorted)
        after[g] -= pod.gpu_milli
        before = self.frag.amount(model, cpu_after + pod.cpu_milli, free_sorted)
        return sigmoid_score(before - self.frag.amount(model, cpu_after, tuple(sorted(after))))

    def score(self, n: int, pod: PodSpec) -> int:
        model = self.cluster.nodes[n].model
        cpu_left = self.cluster.cpu_left[n]
        free_sorted = tuple(sorted(self.cluster.free[n]))
        key = (model, cpu_left, free_sorted, pod.resource_key)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        cpu_after = cpu_left - pod.cpu_milli
        if pod.sharing:
            best, seen = 0, -1
            for g, f in enumerate(free_sorted):
                # Equal free values give equal hypothetical nodes: score each value once.
                if f >= pod.gpu_milli and f != seen:
                    best = max(best, self._gpu_score(model, cpu_after, free_sorted, g, pod))
                    seen = f
        else:
            after = list(free_sorted)
            if pod.gpu_milli > 0:
                # NodeResource.Sub takes the GPUs in ascending order of free milli.
                taken = [g for g, f in enumerate(after) if f >= pod.gpu_milli][: pod.num_gpu]
                for g in taken:
                    after[g] -= pod.gpu_milli
            before = self.frag.amount(model, cpu_left, free_sorted)
            best = sigmoid_score(before - self.frag.amount(model, cpu_after, tuple(sorted(after))))
        self._memo[key] = best
        return best

    def pick_gpus(self, n: int, pod: PodSpec) -> tuple[int, ...]:
        free = self.cluster.free[n]
        if pod.gpu_milli <= 0:
            return ()
        if not pod.sharing:
            return exclusive_gpus(free, pod)
        # The first GPU index reaching the best truncated score, as the plugin's strict '>'.
        model = self.cluster.nodes[n].model
        cpu_after = self.cluster.cpu_left[n] - pod.cpu_milli
        free_sorted = tuple(sorted(free))
        by_value: dict[int, int] = {}
        best_g, best = -1, -1
        for g, f in enumerate(free):
            if f < pod.gpu_milli:
                continue
            if f not in by_value:
                by_value[f] = self._gpu_score(model, cpu_after, free_sorted, free_sorted.index(f), pod)
            if by_value[f] > best:
                best_g, best = g, by_value[f]
        return (best_g,)
