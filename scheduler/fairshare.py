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
from collections.abc import Iterable

from scheduler.cluster import CPU_ONLY, DEDICATED, MIG, MPS, FairShareState, ProjectShare, Request, Running
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
    """

    def __init__(
        self, queue: list[Request], state: FairShareState | None, running: list[Running], now: float
    ) -> None:
        self._state = state
        self._now = now
        per_project: dict[str, list[Request]] = defaultdict(list)
        for request in queue:
            per_project[request.project].append(request)
        self._waiting = {
            p: deque(sorted(rs, key=lambda r: (-r.priority, r.submitted_at, r.id)))
            for p, rs in per_project.items()
        }
        self._usage: dict[str, float] = {}
        if state is not None:
            since = now - state.usage_at if state.usage_at is not None else 0.0
            for name in self._waiting:
                self._usage[name] = decay(state.share(name).usage_gpu_s, since, state.half_life_s)
            for alloc in running:
                if alloc.project in self._usage:
                    self._usage[alloc.project] += commitment_gpu_s(
                        alloc.milli_gpu, alloc.ends_at, now, state.horizon_s
                    )
        self._heap: list[tuple[int, float, float, int, str]] = []
        for name in sorted(self._waiting):
            self._push(name)

    def standing(self, project: str) -> float:
        """Usage per unit of weight; lower goes first. Infinite for a weightless project."""
        if self._state is None:
            return 0.0
        weight = self._state.share(project).weight
        return self._usage.get(project, 0.0) / weight if weight > 0 else math.inf

    def next(self) -> Request | None:
        if not self._heap:
            return None
        *_, project = heapq.heappop(self._heap)
        return self._waiting[project].popleft()

    def settle(self, request: Request, placed_milli: int = 0, ends_at: float | None = None) -> None:
        """Charge what ``request`` was given (nothing if it waits) and queue its project's next."""
        if self._state is not None and placed_milli:
            self._usage[request.project] = self._usage.get(request.project, 0.0) + commitment_gpu_s(
                placed_milli, ends_at, self._now, self._state.horizon_s
            )
        self._push(request.project)

    def _push(self, project: str) -> None:
        waiting = self._waiting[project]
        if waiting:
            head = waiting[0]
            entry = (-head.priority, self.standing(project), head.submitted_at, head.id, project)
            heapq.heappush(self._heap, entry)


class Quotas:
    """Milli-GPU held per project this cycle, against its guarantee and limit."""

    def __init__(self, state: FairShareState | None, running: list[Running]) -> None:
        self._state = state
        self.used: dict[str, int] = defaultdict(int)
        for alloc in running:
            self.used[alloc.project] += alloc.milli_gpu

    def _share(self, project: str) -> ProjectShare:
        return self._state.share(project) if self._state is not None else ProjectShare()

    def refusal(self, project: str, milli: int) -> str:
        """Why ``milli`` more would break the project's limit, or "" when it would not."""
        limit = self._share(project).limit_milli
        if limit is None or self.used[project] + milli <= limit:
            return ""
        return (
            f"quota: project {project} holds {self.used[project]} of its {limit} milli-GPU limit "
            f"and this needs {milli} more"
        )

    def within_guarantee(self, project: str, milli: int) -> bool:
        guaranteed = self._share(project).guaranteed_milli
        return guaranteed is not None and self.used[project] + milli <= guaranteed

    def borrows(self, project: str, milli: int) -> bool:
        """Whether ``milli`` more would run above the guarantee (only where one is set)."""
        guaranteed = self._share(project).guaranteed_milli
        return guaranteed is not None and self.used[project] + milli > guaranteed

    def over_guarantee(self, project: str) -> int:
        """Milli-GPU the project holds above its guarantee: what may be reclaimed from it."""
        guaranteed = self._share(project).guaranteed_milli
        return 0 if guaranteed is None else max(0, self.used[project] - guaranteed)

    def add(self, project: str, milli: int) -> None:
        self.used[project] += milli

    def remove(self, project: str, milli: int) -> None:
        self.used[project] -= milli
