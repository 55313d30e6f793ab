"""Re-implementations of the six policies of the FGD paper (ATC'23), for trace replay.

Each maps a policy name, as ``python -m scheduler.research.replay --policy`` takes it, to a
factory that builds the policy for one replay.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.research.paper.base import ReplayContext, TracePolicy
from scheduler.research.paper.baselines import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProdPolicy,
    PackingPolicy,
    RandomPolicy,
)
from scheduler.research.paper.fgd import FgdPolicy

PAPER_POLICIES: dict[str, Callable[[ReplayContext], TracePolicy]] = {
    "random": RandomPolicy,
    "dotprod": DotProdPolicy,
    "clustering": ClusteringPolicy,
    "packing": PackingPolicy,
    "bestfit": BestFitPolicy,
    "fgd": FgdPolicy,
}
