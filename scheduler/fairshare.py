"""Ordering and admission for the live queue: priority class, decayed fair share, age; quotas.

Usage is GPU-seconds that the caller measures (the billing ledger, or a simulation) and
hands in already decayed to ``FairShareState.usage_at``. A project's standing is its usage
divided by its weight; the lower, the earlier its requests start within a priority class.
Quotas are in milli-GPU: a project may hold up to ``limit_milli`` in all, the part above
``guaranteed_milli`` is borrowed idle capacity that a project still under its guarantee can
take back by preemption.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

from scheduler.cluster import CPU_ONLY, DEDICATED, MIG, MPS, FairShareState, Request, Running
from scheduler.departments import OrgTree, node_label, project_node
from scheduler.fair_tree import ClassTree
from scheduler.gpus import COMPUTE_SLICES

LN2 = math.log(2)


def decay(value: float, elapsed_s: float, half_life_s: float) -> float:
    """``value`` after ``elapsed_s`` of exponential decay; a half-life of 0 forgets at once."""
    if elapsed_s <= 0:
        return value
    if half_life_s <= 0:
        return 0.0
    return value * math.exp(-LN2 * elapsed_s / half_life_s)


def decayed_usage(intervals: Iterable[tuple[float, float, int]], now: float, half_life_s: float) -> float:
    """GPU-seconds of ``(start, end, milli_gpu)`` intervals, each second weighted by its age.

    The exact integral of ``milli/1000 * 2**(-(now - t) / half_life)`` over each interval,
    so a caller can rebuild a project's usage from ledger rows without keeping state.
    """
    if half_life_s <= 0:
        return 0.0
    rate = LN2 / half_life_s
    total = 0.0
    for start, end, milli in intervals:
        end = min(end, now)
        if end > start:
            # expm1 keeps the precision a difference of two nearly equal exponentials loses.
            total += milli / 1000 / rate * math.exp(-rate * (now - end)) * -math.expm1(-rate * (end - start))
    return total


def demand_milli(request: Request, timeslice_milli: int = 1000) -> int:
    """What the request will count against its quota, before it is placed: nothing for a
    CPU-only request, which holds no GPU (its placement's grants are empty, too)."""
    if request.mode == CPU_ONLY:
        return 0
    if request.mode == DEDICATED:
        return 1000 * request.gpu_count
    if request.mode == MIG:
        # Profile names start with their compute slices ("3g.40gb"), whatever the model.
        slices = request.mig_profile.split("g", 1)[0]
        return (int(slices) if slices.isdigit() else 1) * 1000 // COMPUTE_SLICES
    if request.mode == MPS:
        return max(1, request.mps_thread_pct * 10)
    return timeslice_milli


def commitment_gpu_s(milli: int, ends_at: float | None, now: float, horizon_s: float) -> float:
    """GPU-seconds an allocation will add over the next ``horizon_s``, or until it ends."""
    left = horizon_s if ends_at is None else max(0.0, min(horizon_s, ends_at - now))
    return milli / 1000 * left


class FairOrder:
    """Hands out queued requests one at a time: priority class, then fair share, then age.

    Each project's standing is recomputed as its requests are placed (``settle``), so one
    cycle shares the free capacity out by weight instead of giving all of it to the project
    that was furthest behind when the cycle began. Without a ``FairShareState`` the order is
    priority, then age, then id (every project's standing is equal). Ordering by standing,
    usage / weight lowest first, is ordering by Slurm's classic factor ``2**(-U/S)`` highest
    first (U the project's part of all usage, S its part of all weight).

    With departments (scheduler/departments.py) fair share follows the tree, as Slurm's fair
    tree does: siblings are ordered by their own standing at each level, the top first, so a
    project of a department that used little goes before one of a department that used much,
    whatever the two projects used themselves (``scheduler/fair_tree.py``: a heap per node
    and priority class, so a placement keys again only its project's path).
    """

    def __init__(
        self, queue: list[Request], state: FairShareState | None, running: list[Running], now: float
    ) -> None:
        self._state = state
        self._now = now
        self._tree = OrgTree(state)
        per_project: dict[str, list[Request]] = defaultdict(list)
        for request in queue:
            per_project[request.project].append(request)
        self._waiting = {
            p: deque(sorted(rs, key=lambda r: (-r.priority, r.submitted_at, r.id)))
            for p, rs in per_project.items()
        }
        self._usage: dict[str, float] = {}  # by project (flat), or by node of the tree
        if state is not None:
            since = now - state.usage_at if state.usage_at is not None else 0.0
            counted = self._waiting if self._tree.flat else {*self._waiting, *state.projects}
            for name in counted:
                self._charge(name, decay(state.share(name).usage_gpu_s, since, state.half_life_s))
            for alloc in running:
                if alloc.project in counted:
                    self._charge(
                        alloc.project, commitment_gpu_s(alloc.milli_gpu, alloc.ends_at, now, state.horizon_s)
                    )
        self._heap: list[tuple[int, float, float, int, str]] = []
        self._classes: dict[int, ClassTree] = {}  # by priority, highest first (with departments)
        if not self._tree.flat:
            for priority in sorted({r.priority for r in queue}, reverse=True):
                self._classes[priority] = ClassTree(self._tree, self._node_standing)
            for name, requests in sorted(per_project.items()):
                for priority in {r.priority for r in requests}:
                    self._classes[priority].add(name, (r for r in requests if r.priority == priority))
            return
        for name in sorted(self._waiting):
            self._push(name)

    def _charge(self, project: str, gpu_s: float) -> None:
        if self._tree.flat:
            self._usage[project] = self._usage.get(project, 0.0) + gpu_s
            return
        for node in self._tree.path(project):
            self._usage[node] = self._usage.get(node, 0.0) + gpu_s

    def standing(self, project: str) -> float:
        """Usage per unit of weight; lower goes first. Infinite for a weightless project."""
        if self._state is None:
            return 0.0
        if not self._tree.flat:
            return self._node_standing(project_node(project))
        weight = self._state.share(project).weight
        return self._usage.get(project, 0.0) / weight if weight > 0 else math.inf

    def _node_standing(self, node: str) -> float:
        weight = self._tree.weight(node)
        return self._usage.get(node, 0.0) / weight if weight > 0 else math.inf

    def next(self) -> Request | None:
        for tree in self._classes.values():
            if (request := tree.next()) is not None:
                return request
        if not self._heap:
            return None
        *_, project = heapq.heappop(self._heap)
        return self._waiting[project].popleft()

    def settle(self, request: Request, placed_milli: int = 0, ends_at: float | None = None) -> None:
        """Charge what ``request`` was given (nothing if it waits) and queue its project's next."""
        if self._state is not None and placed_milli:
            self._charge(
                request.project, commitment_gpu_s(placed_milli, ends_at, self._now, self._state.horizon_s)
            )
        if self._classes:
            for tree in self._classes.values():  # its levels' standings count in every class
                tree.refresh(request.project)
            return
        self._push(request.project)

    def _push(self, project: str) -> None:
        waiting = self._waiting[project]
        if waiting:
            head = waiting[0]
            entry = (-head.priority, self.standing(project), head.submitted_at, head.id, project)
            heapq.heappush(self._heap, entry)


class Quotas:
    """Milli-GPU held this cycle by each project and each department above it (the tree:
    scheduler/departments.py), against their guarantees and limits."""

    def __init__(self, state: FairShareState | None, running: list[Running]) -> None:
        self.tree = OrgTree(state)
        self.used: dict[str, int] = defaultdict(int)  # by node: p:<project>, d:<department>
        for alloc in running:
            self.add(alloc.project, alloc.milli_gpu)

    def refusal(self, project: str, milli: int, freeing: Sequence[Running] = ()) -> str:
        """Why ``milli`` more would break a limit on the project's path, or "" when none;
        ``freeing``: sandboxes whose shares are given back first (a reclaim's victims)."""
        for node in self.refused_along(project, milli, freeing):
            held = self.used[node] - self._freed(node, freeing)
            return (
                f"quota: {node_label(node)} holds {held} of its {self.tree.limit(node)} milli-GPU "
                f"limit and this needs {milli} more"
            )
        return ""

    def refused_along(self, project: str, milli: int, freeing: Sequence[Running] = ()) -> list[str]:
        """The levels of the project's path, lowest first, whose limits ``milli`` more would
        break (after ``freeing``'s shares are given back)."""
        return [
            node
            for node in self.tree.path(project)
            if (limit := self.tree.limit(node)) is not None
            and self.used[node] - self._freed(node, freeing) + milli > limit
        ]

    def _freed(self, node: str, freeing: Sequence[Running]) -> int:
        return sum(v.milli_gpu for v in freeing if node in self.tree.path(v.project))

    def short_of(self, node: str, milli: int) -> int:
        """How much a node's limit is short of ``milli`` more: what victims under it must free."""
        limit = self.tree.limit(node)
        return 0 if limit is None else self.used[node] + milli - limit

    def may_reclaim(self, project: str, milli: int) -> bool:
        """Whether some level on the project's path would still be within its guarantee with
        ``milli`` more: only then can it take borrowed capacity back (``reclaim_side``)."""
        return any(
            (g := self.tree.guaranteed(node)) is not None and self.used[node] + milli <= g
            for node in self.tree.path(project)
        )

    def reclaim_side(self, project: str, milli: int, holder: str) -> str | None:
        """The node ``holder``'s sandboxes may be reclaimed from by a request of ``project``
        for ``milli``: the holder's side where the two meet, when it is over its guarantee
        and the requester's side would be within its own. None when no reclaim applies."""
        sides = self.tree.sides(project, holder)
        if sides is None:
            return None
        mine, theirs = sides
        guaranteed = self.tree.guaranteed(mine)
        if guaranteed is None or self.used[mine] + milli > guaranteed:
            return None
        return theirs if self.over_guarantee(theirs) > 0 else None

    def borrows(self, project: str, milli: int) -> bool:
        """Whether ``milli`` more would take some level of the project's path over its
        guarantee (only levels with one count)."""
        return self.borrowing_level(project, milli) is not None

    def borrowing_level(self, project: str, milli: int) -> str | None:
        """The lowest level ``milli`` more would take over its guarantee, or None."""
        for node in self.tree.path(project):
            guaranteed = self.tree.guaranteed(node)
            if guaranteed is not None and self.used[node] + milli > guaranteed:
                return node
        return None

    def over_anywhere(self, project: str) -> bool:
        return any(self.over_guarantee(node) > 0 for node in self.tree.path(project))

    def over_guarantee(self, node: str) -> int:
        """Milli-GPU a node holds above its guarantee: what may be reclaimed from it."""
        guaranteed = self.tree.guaranteed(node)
        return 0 if guaranteed is None else max(0, self.used[node] - guaranteed)

    def add(self, project: str, milli: int) -> None:
        for node in self.tree.path(project):
            self.used[node] += milli

    def remove(self, project: str, milli: int) -> None:
        for node in self.tree.path(project):
            self.used[node] -= milli
