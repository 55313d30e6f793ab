"""What a trace-replay policy is: a node score plus a GPU pick, as in the paper's plugins."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from scheduler.placement.fragmentation import Fragmentation
from scheduler.research.paper.cluster import Cluster, best_fit_gpu, exclusive_gpus
from scheduler.research.trace import PodSpec


@dataclass(frozen=True)
class ReplayContext:
    """What a policy may read: the live cluster, FGD's target workload, the seeded RNG."""

    cluster: Cluster
    frag: Fragmentation
    rng: random.Random


class TracePolicy(Protocol):
    name: str
    # True: the node is drawn uniformly among the feasible ones and ``score`` is unused.
    random_node: bool

    def score(self, n: int, pod: PodSpec) -> int:
        """Integer score of a feasible node; the highest wins, ties go to node priority.

        It must depend only on node ``n``'s own state: the replay re-scores a node only
        after something is placed on it.
        """
        ...

    def pick_gpus(self, n: int, pod: PodSpec) -> tuple[int, ...]:
        """GPU indices on the chosen node; empty for pods without GPU milli."""
        ...


class BestGpu:
    """The ``best`` GPU selection: tightest GPU for a share, lowest free GPUs otherwise."""

    def __init__(self, ctx: ReplayContext) -> None:
        self.cluster = ctx.cluster

    def pick_gpus(self, n: int, pod: PodSpec) -> tuple[int, ...]:
        free = self.cluster.free[n]
        if pod.gpu_milli <= 0:
            return ()
        if pod.sharing:
            return (best_fit_gpu(free, pod.gpu_milli),)
        return exclusive_gpus(free, pod)
