"""FGD: place each pod where it grows the node's fragmentation F(n) the least.

Score = trunc(100 x sigmoid((F(before) - F(after)) / 1000)). A sharing pod is tried on
every GPU that fits, the node scoring its best GPU; other pods take the lowest free GPUs.
Scores depend on (model, CPU left, free GPUs as a multiset, pod shape) only, and nodes
in a large cluster repeat those states, so they are memoised on that key.
"""

from __future__ import annotations

import math

from scheduler.research.paper.base import ReplayContext
from scheduler.research.paper.cluster import exclusive_gpus, exclusive_outcome, sharing_outcomes
from scheduler.research.trace import PodSpec

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

    def _sharing_scores(
        self, model: str, cpu_left: int, free_sorted: tuple[int, ...], pod: PodSpec
    ) -> dict[int, int]:
        """Score of a sharing pod on a GPU, by that GPU's free milli (equal values score alike)."""
        before = self.frag.amount(model, cpu_left, free_sorted)
        cpu_after = cpu_left - pod.cpu_milli
        return {
            free_sorted[g]: sigmoid_score(before - self.frag.amount(model, cpu_after, tuple(sorted(after))))
            for g, after in sharing_outcomes(free_sorted, pod)
        }

    def score(self, n: int, pod: PodSpec) -> int:
        model = self.cluster.nodes[n].model
        cpu_left = self.cluster.cpu_left[n]
        free_sorted = tuple(sorted(self.cluster.free[n]))
        key = (model, cpu_left, free_sorted, pod.resource_key)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        cpu_after = cpu_left - pod.cpu_milli
        before = self.frag.amount(model, cpu_left, free_sorted)

        def gain(after: list[int]) -> int:
            return sigmoid_score(before - self.frag.amount(model, cpu_after, tuple(sorted(after))))

        if pod.sharing:
            best = max(self._sharing_scores(model, cpu_left, free_sorted, pod).values(), default=0)
        else:
            best = gain(exclusive_outcome(free_sorted, pod))
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
        by_value = self._sharing_scores(model, self.cluster.cpu_left[n], tuple(sorted(free)), pod)
        best_g, best = -1, -1
        for g, f in enumerate(free):
            if f < pod.gpu_milli:
                continue
            if by_value[f] > best:
                best_g, best = g, by_value[f]
        return (best_g,)
