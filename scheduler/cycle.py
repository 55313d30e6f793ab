"""One scheduling cycle: order, admit, place, preempt, reserve and backfill -> decisions.

Requests are taken in fair-share order (``FairOrder``). For each one, in turn:

1. quota: a request that would take its project over its limit waits;
2. placement by the policy, with the devices reserved for the queue head hidden unless the
   request is known to finish before the reservation starts (backfill);
3. failing that, a preemption plan: lower-priority preemptible sandboxes, or borrowed ones
   when the request is within its project's guarantee; the ``Preempt`` decisions come
   just before the ``Place`` that reuses their devices, so committing the list in order
   frees them first;
4. failing that, the first request blocked by capacity becomes the queue head: the cycle
   replays the known end times of what runs (start + max duration) until the head fits,
   and ``Reserve``s those devices from then on (when nothing that blocks it has an end
   time, or the head would start only beyond the backfill window, the next blocked
   request of another shape is tried, a few at most);
5. a ``Pending`` with the reason, for every request that does not start.

Every request in the queue gets exactly one ``Place`` or ``Pending``.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from functools import cached_property

from scheduler.cluster import (
    CPU_ONLY,
    DEDICATED,
    MIG,
    MILLI,
    MODES,
    MPS,
    TIMESLICE,
    Decision,
    DeviceGrant,
    FairShareState,
    GpuState,
    MigSlot,
    Pending,
    Place,
    Preempt,
    Request,
    Reserve,
    Running,
    Snapshot,
    book,
    release,
)
from scheduler.departments import node_label
from scheduler.fairshare import FairOrder, Quotas, demand_milli
from scheduler.gc_pause import collection_paused
from scheduler.model_quotas import ModelQuotas
from scheduler.placement import Policy
from scheduler.placement.gang import place_gang
from scheduler.preemption import Plan, plan_preemption, victim_order

# Blocked requests tried in turn for the head's reservation when the ones before them could
# not get one (nothing that blocks them has an end time): bounds the replays per cycle.
MAX_RESERVE_TRIES = 8
# How far ahead a queue head may be given a reservation (as Slurm's bf_window defaults to).
BACKFILL_WINDOW_S = 86_400.0

# What a placement policy sees of a request, and what a preemption plan also depends on.
# (mode, GPUs, MIG profile, MPS memory, MPS threads, CPU, memory, isolation, GPU models)
FitShape = tuple[str, int, str, int, int, int, int, str, tuple[str, ...]]
Shape = tuple[FitShape, int, bool, bool, bool, str, str]


def revert(snapshot: Snapshot, decisions: Sequence[Decision], requests: Sequence[Request]) -> None:
    """Undo on ``snapshot`` what ``run_cycle(..., in_place=True)`` applied of ``decisions``:
    give back each Place's devices, CPU and memory, and book again what each Preempt
    released. ``requests`` holds those placed. Latest first: a later booking may sit on
    what an earlier victim freed. Hosts touched are reported through ``changed``."""
    hosts = {h.name: h for h in snapshot.hosts}
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    asked = {r.id: r for r in requests}
    held = {r.sandbox_id: r for r in snapshot.running}
    for decision in reversed(decisions):
        if isinstance(decision, Place):
            request = asked[decision.request_id]
            for grant in decision.grants:
                release(gpus[grant.gpu_uuid], grant)
            hosts[decision.host].take(request.cpu_milli, request.memory_mib, -1)
            snapshot.changed(decision.host)
        elif isinstance(decision, Preempt):
            victim = held[decision.sandbox_id]
            for grant in victim.grants:
                book(gpus[grant.gpu_uuid], grant)
            if victim.host in hosts:
                hosts[victim.host].take(victim.cpu_milli, victim.memory_mib)
                snapshot.changed(victim.host)


def run_cycle(
    snapshot: Snapshot,
    queue: list[Request],
    policy: Policy,
    now: float,
    *,
    fairshare: FairShareState | None = None,
    in_place: bool = False,
    held: tuple[Request, Reserve] | None = None,
    backfill_window_s: float = BACKFILL_WINDOW_S,
    explain: bool = True,
) -> list[Decision]:
    """Decisions for every request in ``queue``.

    The snapshot given is not modified, unless ``in_place``: then it ends the cycle with
    every decision applied (placements booked, victims released), which spares a copy of
    the fleet to a caller that keeps its state between cycles, and lets the policy keep
    what it remembered of it. Without ``fairshare`` the queue is ordered by priority and
    age and no quota applies; without ``snapshot.running`` nothing can be preempted or
    reserved.

    ``held`` is a queue head and its reservation from an earlier cycle, honoured as if this
    cycle had made it (its ``Reserve`` comes first): the request form's preview asks about
    one request that ranks behind the last cycle's head, so it keeps off the head's devices
    unless known to end before the head starts, and gets no reservation of its own.

    A head that could start only more than ``backfill_window_s`` from ``now`` gets no
    reservation (Slurm's ``bf_window``): holding capacity idle for days on end times
    that far off, which are limits rather than forecasts, costs everyone now.
    """
    # Latency-bound: the collector would walk every object the policy remembers, over and
    # over, for garbage reference counting frees anyway (see scheduler/gc_pause.py). Every
    # caller gets this: the control worker, the request form's preview, the replays.
    with collection_paused():
        cycle = _Cycle(snapshot if in_place else snapshot.copy(), policy, now, fairshare, backfill_window_s)
        cycle.explain = explain
        if held is not None:
            cycle.hold_for(*held)
        return cycle.run(queue)


class _Cycle:
    def __init__(
        self,
        working: Snapshot,
        policy: Policy,
        now: float,
        fairshare: FairShareState | None,
        backfill_window_s: float = BACKFILL_WINDOW_S,
    ):
        self.working = working
        self.policy = policy
        self.now = now
        self.horizon = now + backfill_window_s  # no reservation starts later than this
        self.fairshare = fairshare
        self.hosts = {h.name: h for h in self.working.hosts}
        # What holds devices, by sandbox id: running before the cycle, then placed in it.
        self.running = {r.sandbox_id: r for r in self.working.running}
        self.quotas = Quotas(fairshare, self.working.running)
        self.model_quotas = ModelQuotas(fairshare, self.working.running, self._model_of)
        self.decisions: list[Decision] = []
        self.head: Request | None = None
        self.reservation: Reserve | None = None
        self.head_holders: set[int] = set()  # sandboxes on the head's reserved devices
        # Shapes no preemption plan could serve. Free capacity plus what the candidates hold
        # only shrinks as the cycle places requests, so a failed plan stays failed; the one
        # exception (a project going over its guarantee) empties it.
        self.hopeless: set[Shape] = set()
        # Possible victims by the sharing mode of the devices they hold, in victim order:
        # only sandboxes that ran before this cycle, and only a request's own mode helps it.
        # A CPU-only request can use what any victim frees: its host's CPU and memory. Only
        # what is preemptible or borrowed can ever be a victim (see ``_preemption``): in a
        # fleet of protected work the list stays short, however much runs.
        self.victims: dict[str, list[Running]] = {mode: [] for mode in (*MODES, CPU_ONLY)}
        candidates = (r for r in self.working.running if r.preemptible or r.borrowed)
        for alloc in sorted(candidates, key=victim_order):
            held = [self.gpus[g.gpu_uuid] for g in alloc.grants if g.gpu_uuid in self.gpus]
            if len({gpu.host for gpu in held}) > 1:
                continue  # a gang across hosts: a preemption frees one host's part, and stops it all
            for mode in MODES:
                if any(gpu.could_serve(mode) for gpu in held):
                    self.victims[mode].append(alloc)
            self.victims[CPU_ONLY].append(alloc)
        # Request shapes the end-time replay found no start for. Once everything with an end
        # has ended the fleet is no freer for a later request of the same shape (short of a
        # preemption ending an unbounded sandbox), so it is not replayed again.
        self.unreservable: set[FitShape] = set()
        self.waiting_by_mode: Counter[tuple[str, int]] = Counter()
        # The policy's answer for request shapes it could not place, by whether the head's
        # devices were hidden: capacity only shrinks as the cycle places requests, so the
        # answer holds for every later request of the shape until something is released
        # (a preemption) or the hidden devices change (a new reservation).
        # Kept per kind (mode, MIG profile, isolation, GPU models, hidden) as the sizes that
        # failed: a request at least as large in every size fails too.
        self.unfit: dict[tuple[str, str, str, tuple[str, ...], bool], list[tuple[tuple[int, ...], str]]] = {}
        # The policy's answer with the hidden devices in view, per shape, as of a commit
        # count: what ``_reason`` tells a request that waits behind the head. A place found
        # is asked again after each commit (it may be taken); a refusal holds, as ``unfit``'s
        # do, until capacity is given back.
        self.unhidden: dict[FitShape, tuple[int, Place | Pending]] = {}
        self.commits = 0
        # Without it a request that waits gets the policy's first answer, unexplained, and no
        # reservation (the request form's answer per GPU model: a place in line is enough).
        self.explain = True

    # Both read every GPU of the fleet, and most cycles need neither: a placement books its
    # grants through its host's few GPUs (``_commit``), and only a time-slice request's quota
    # needs the replica size. Built every cycle, they were a tenth of a cycle's time.
    @cached_property
    def gpus(self) -> dict[str, GpuState]:
        return {g.uuid: g for h in self.working.hosts for g in h.gpus}

    @cached_property
    def timeslice_milli(self) -> int:
        replicas = [g.replicas for g in self.gpus.values() if g.could_serve(TIMESLICE) and g.replicas]
        return 1000 // max(replicas) if replicas else 1000

    def _model_of(self, gpu_uuid: str) -> str:
        gpu = self.gpus.get(gpu_uuid)
        return gpu.model if gpu is not None else ""

    @cached_property
    def _fleet_models(self) -> set[str]:
        # Asked by every request a model limit narrows: once a cycle, not once a request.
        return {gpu.model for gpu in self.gpus.values()}

    def _within_model_limits(self, request: Request, demand: int) -> tuple[Request | None, str]:
        """``request`` narrowed to the GPU models its project's model limits leave it, with a
        note of those left out (for its reason if it waits); None (and its Pending decision)
        when they leave none."""
        if not self.model_quotas:
            return request, ""
        narrowed = self.model_quotas.narrow(request, demand, lambda: self._fleet_models)
        if narrowed.refusal:
            self.decisions.append(Pending(request.id, narrowed.refusal))
            return None, ""
        return narrowed.request, narrowed.kept_off

    def run(self, queue: list[Request]) -> list[Decision]:
        order = FairOrder(queue, self.fairshare, self.working.running, self.now)
        while (request := order.next()) is not None:
            place = self._decide(request)
            if place is None:
                order.settle(request)
            else:
                order.settle(request, sum(g.milli_gpu for g in place.grants), self._ends_at(request))
        return self.decisions

    def _decide(self, request: Request) -> Place | None:
        if request.nodes > 1:
            return self._decide_gang(request)
        demand = demand_milli(request, self.timeslice_milli if request.mode == TIMESLICE else 1000)
        refusal = self.quotas.refusal(request.project, demand)
        # At a department's limit, a project within its guarantee there may still take back
        # what a sibling borrowed: the swap leaves the department where it was.
        limit_at = self._limit_to_reclaim_under(request, demand) if refusal else ""
        if refusal and not limit_at:
            self.decisions.append(Pending(request.id, refusal))
            return None
        within, kept_off = self._within_model_limits(request, demand)
        if within is None:
            return None
        request = within
        if limit_at:
            swap = self._preemption(request, demand, under=limit_at)
            # The grants can differ from the estimate (a time-slice replica's share): checked
            # again, with the victims' shares given back, as the plain path checks them.
            if swap is None or self.quotas.refusal(
                request.project, sum(g.milli_gpu for g in swap.place.grants), freeing=swap.victims
            ):
                self.decisions.append(Pending(request.id, refusal))
                return None
            return self._commit(request, swap.place, swap.victims)
        plan: Plan | None = None
        kind, sizes = _fit_kind(request, self._hides(request))
        known = next(
            (why for failed, why in self.unfit.get(kind, ()) if all(map(operator.le, failed, sizes))), None
        )
        decision: Place | Pending
        if known is not None:
            decision = Pending(request.id, known)
            plan = self._preemption(request, demand)
        else:
            hides = self._hides(request)
            with self._hide_reserved(request):
                # Behind the head, ``_reason`` asks again with its devices in view and
                # says why from that: the answer with them hidden needs no reason.
                decision = self.policy.place(self.working, request, explain=self.explain and not hides)
                if not isinstance(decision, Place):
                    self.unfit.setdefault(kind, []).append((sizes, decision.reason))
                    plan = self._preemption(request, demand)
        if plan is not None:
            decision = plan.place
        if isinstance(decision, Place):
            # The estimate above can differ from the grants (a time-slice replica's share).
            refusal = self.quotas.refusal(request.project, sum(g.milli_gpu for g in decision.grants))
            if not refusal:
                return self._commit(request, decision, plan.victims if plan else ())
            self.decisions.append(Pending(request.id, refusal))
            return None
        reason = self._reason(request, decision.reason)
        self.decisions.append(Pending(request.id, f"{reason}; {kept_off}" if kept_off else reason))
        self.waiting_by_mode[(request.mode, request.priority)] += 1
        return None

    def _decide_gang(self, request: Request) -> Place | None:
        """A multi-node request: placed all or nothing where it fits now (``place_gang``),
        within its project's quota; it neither preempts nor holds a reservation."""
        demand = request.nodes * request.gpu_count * MILLI
        refusal = self.quotas.refusal(request.project, demand)
        kept_off = ""
        if not refusal:
            within, kept_off = self._within_model_limits(request, demand)
            if within is None:
                return None
            request = within
        decision = Pending(request.id, refusal) if refusal else place_gang(self.working, request)
        if isinstance(decision, Pending) and kept_off:
            decision = Pending(request.id, f"{decision.reason}; {kept_off}")
        if isinstance(decision, Place):
            return self._commit(request, decision, ())
        self.decisions.append(decision)
        self.waiting_by_mode[(request.mode, request.priority)] += 1
        return None

    def _commit(self, request: Request, place: Place, victims: tuple[Running, ...]) -> Place:
        for victim in victims:
            self.decisions.append(Preempt(victim.sandbox_id, self._preempt_reason(request, victim)))
            for grant in victim.grants:
                release(self.gpus[grant.gpu_uuid], grant)
            if victim.host in self.hosts:
                self.hosts[victim.host].take(victim.cpu_milli, victim.memory_mib, -1)
            self.working.changed(victim.host)
            self.quotas.remove(victim.project, victim.milli_gpu)
            self.model_quotas.remove(victim.project, victim.grants)
        self.commits += 1
        if victims:
            self.unfit.clear()  # capacity was given back
            self.unhidden.clear()
            gone = {v.sandbox_id for v in victims}
            for sandbox_id in gone:
                del self.running[sandbox_id]
            self.victims[request.mode] = [v for v in self.victims[request.mode] if v.sandbox_id not in gone]
        milli = sum(g.milli_gpu for g in place.grants)
        borrowed = self.quotas.borrows(request.project, milli)
        was_over = self.quotas.over_anywhere(request.project)
        # A gang's grants are on several hosts, each of which gives the tier's CPU and memory.
        taken = (
            {place.host} | {self.gpus[g.gpu_uuid].host for g in place.grants}
            if request.nodes > 1
            else {place.host}
        )
        for name in taken:
            host = self.hosts[name]
            for grant in place.grants:
                found = next((g for g in host.gpus if g.uuid == grant.gpu_uuid), None)
                if found is not None:
                    book(found, grant)
            host.take(request.cpu_milli, request.memory_mib)
            self.working.changed(name)
        self.quotas.add(request.project, milli)
        self.model_quotas.add(request.project, place.grants)
        if borrowed and not was_over:
            # Its project's older borrowed sandboxes just became reclaimable.
            self.hopeless.clear()
        self.running[request.id] = Running(
            request.id,
            request.project,
            place.host,
            place.grants,
            priority=request.priority,
            started_at=self.now,
            ends_at=self._ends_at(request),
            borrowed=borrowed,
            cpu_milli=request.cpu_milli,
            memory_mib=request.memory_mib,
        )
        if borrowed:
            place = replace(place, borrowed=True)
        self.decisions.append(place)
        return place

    def _ends_at(self, request: Request) -> float | None:
        return self.now + request.max_duration_s if request.max_duration_s > 0 else None

    # --- preemption ------------------------------------------------------------------------

    def _limit_to_reclaim_under(self, request: Request, demand: int) -> str:
        """The department to reclaim under when only departments' limits refuse ``request``
        (the lowest of them: its victims are under every one above it too) and the request
        may reclaim; "" otherwise. ``allowed`` then asks the victims to free what each of
        those limits is short of."""
        refusing = self.quotas.refused_along(request.project, demand)
        if not refusing or any(node.startswith("p:") for node in refusing):
            return ""
        return refusing[0] if self.quotas.may_reclaim(request.project, demand) else ""

    def _preemption(self, request: Request, demand: int, under: str = "") -> Plan | None:
        """The fewest victims that make room for ``request``. ``under``: a department whose
        limit refused it; only reclaims inside it, freeing what the limit is short of."""
        reclaim = self.quotas.may_reclaim(request.project, demand)
        borrowing = self.quotas.borrows(request.project, demand)
        shape: Shape = (
            _fit_shape(request),
            request.priority,
            reclaim,
            borrowing,
            self._hides(request),
            under,
            # Whether a reclaim can help depends on where the requester sits in the tree (and,
            # flat, on its not being the holder): a plan one project could not make another may.
            request.project if reclaim else "",
        )
        if shape in self.hopeless:
            return None
        candidates: list[Running] = []
        reclaim_only: dict[int, str] = {}  # sandbox id -> the node its reclaim takes down
        refusing = self.quotas.refused_along(request.project, demand) if under else []
        # Preempting what holds the head's devices would hand them to a request behind it.
        spared = self.head_holders if self._hides(request) else set()
        for alloc in self.victims[request.mode]:
            if alloc.sandbox_id in spared or alloc.preemptible_at > self.now:
                continue
            if under and under not in self.quotas.tree.path(alloc.project):
                continue
            # A borrowing request may not push out what another project runs within its guarantee,
            # or the two would take the same devices from each other cycle after cycle.
            by_priority = (
                alloc.preemptible and alloc.priority < request.priority and (alloc.borrowed or not borrowing)
            )
            if under:
                by_priority = False  # only a reclaim frees what the department's limit needs
            side = (
                self.quotas.reclaim_side(request.project, demand, alloc.project)
                if reclaim and alloc.borrowed and not by_priority
                else None
            )
            if by_priority or side is not None:
                candidates.append(alloc)
                if side is not None:
                    reclaim_only[alloc.sandbox_id] = side

        def allowed(victims: Sequence[Running]) -> bool:
            """A reclaim takes a project (or the department that borrowed) down towards its
            guarantee, never below it."""
            taken: dict[str, list[int]] = {}
            for v in victims:
                if v.sandbox_id in reclaim_only:
                    taken.setdefault(reclaim_only[v.sandbox_id], []).append(v.milli_gpu)
            if under:
                freed = sum(v.milli_gpu for v in victims)
                if any(freed < self.quotas.short_of(node, demand) for node in refusing):
                    return False
            return all(sum(m) - max(m) < self.quotas.over_guarantee(node) for node, m in taken.items())

        plan = (
            plan_preemption(self.working, request, self.policy, candidates, allowed, gpus=self.gpus)
            if candidates
            else None
        )
        if plan is None:
            self.hopeless.add(shape)
        return plan

    def _preempt_reason(self, request: Request, victim: Running) -> str:
        if victim.preemptible and victim.priority < request.priority:
            return (
                f"preempted for request #{request.id} of higher priority "
                f"({request.priority} > {victim.priority})"
            )
        sides = self.quotas.tree.sides(request.project, victim.project)
        theirs, mine = (node_label(sides[1]), node_label(sides[0])) if sides else ("its project", "its own")
        if theirs == f"project {victim.project}" and mine == f"project {request.project}":
            return (
                f"reclaimed: project {victim.project} borrowed this capacity over its guarantee and "
                f"project {request.project} (request #{request.id}) is within its own"
            )
        return (
            f"reclaimed: {theirs} (of project {victim.project}) borrowed this capacity over its guarantee "
            f"and {mine} is within its own for project {request.project} (request #{request.id})"
        )

    # --- reservation and backfill ----------------------------------------------------------

    def _hides(self, request: Request) -> bool:
        """Whether the reserved devices are off limits: unless it ends before the head starts."""
        res = self.reservation
        if res is None:
            return False
        return not (request.max_duration_s > 0 and self.now + request.max_duration_s <= res.at)

    @contextmanager
    def _hide_reserved(self, request: Request) -> Iterator[None]:
        if self.reservation is None or not self._hides(request):
            yield
            return
        gpus: list[tuple[GpuState, bool]] = []
        slots: list[tuple[MigSlot, bool]] = []
        for grant in self.reservation.grants:
            gpu = self.gpus[grant.gpu_uuid]
            if grant.kind == MIG:
                # MIG instances are separate devices: only the reserved one is held back.
                for slot in gpu.mig:
                    if slot.uuid == grant.mig_uuid:
                        slots.append((slot, slot.busy))
                        slot.busy = True
            else:
                gpus.append((gpu, gpu.available))
                gpu.available = False
        self.working.changed(self.reservation.host)
        try:
            yield
        finally:
            for slot, busy in reversed(slots):
                slot.busy = busy
            for gpu, available in reversed(gpus):
                gpu.available = available
            self.working.changed(self.reservation.host)

    def hold_for(self, head: Request, reservation: Reserve) -> None:
        """Make ``head`` the queue head: requests after it keep off its devices from now on."""
        self.head, self.reservation = head, reservation
        self.unfit.clear()  # what is hidden changed
        held = {_device(g) for g in reservation.grants}
        self.head_holders = {
            r.sandbox_id for r in self.running.values() if any(_device(g) in held for g in r.grants)
        }
        self.decisions.append(reservation)

    def _reserve(self, request: Request) -> Reserve | None:
        """When and where the head could start if everything running ends on time.

        Replays the end times on the working snapshot itself, giving every device back
        afterwards: cheaper than copying the fleet, and ``release`` and ``book`` are exact
        inverses.
        """
        ending = sorted(
            (max(r.ends_at, self.now), r.sandbox_id, r)
            for r in self.running.values()
            if r.ends_at is not None
        )
        released: list[Running] = []
        try:
            for at, _, alloc in ending:
                if at > self.horizon:
                    return None
                host = self.hosts.get(alloc.host)
                if host is None or not host.up:
                    continue
                released.append(alloc)
                for grant in alloc.grants:
                    release(self.gpus[grant.gpu_uuid], grant)
                host.take(alloc.cpu_milli, alloc.memory_mib, -1)
                decision = self.policy.place(Snapshot(hosts=[host]), request)
                if isinstance(decision, Place):
                    return Reserve(request.id, host.name, at, decision.grants)
            return None
        finally:
            for alloc in released:
                for grant in alloc.grants:
                    book(self.gpus[grant.gpu_uuid], grant)
                self.hosts[alloc.host].take(alloc.cpu_milli, alloc.memory_mib)

    def _reason(self, request: Request, why: str) -> str:
        """Say why it waits: capacity, the head's reservation, priority, borrowing.

        ``why`` is the policy's answer, given with the reserved devices hidden when they were.
        """
        if not self.explain:
            return why
        notes = [why]
        if self.reservation is None:
            shape = _fit_shape(request)
            if len(self.unreservable) < MAX_RESERVE_TRIES and shape not in self.unreservable:
                reservation = self._reserve(request)
                if reservation is None:
                    self.unreservable.add(shape)
                else:
                    self.hold_for(request, reservation)
                    notes = [f"{why}; {reservation.host} is reserved for it from {_when(reservation.at)}"]
        elif self.head is not None and self._hides(request):
            # Hidden devices read as drained to the policy: ask again with them in view.
            shape = _fit_shape(request)
            asked = self.unhidden.get(shape)
            if asked is None or (asked[0] != self.commits and isinstance(asked[1], Place)):
                asked = self.unhidden[shape] = (self.commits, self.policy.place(self.working, request))
            unhidden = asked[1]
            if isinstance(unhidden, Place):
                head = self.head
                rank = "higher-priority" if head.priority > request.priority else "older"
                if head.priority == request.priority and head.submitted_at > request.submitted_at:
                    rank = "fair-share-ahead"
                notes = [
                    f"reserved: the capacity that fits it is held for the {rank} request #{head.id} "
                    f"from {_when(self.reservation.at)}; it could backfill only if known to end by then"
                ]
            else:
                notes = [unhidden.reason]
        ahead = sum(
            n
            for (mode, prio), n in self.waiting_by_mode.items()
            if mode == request.mode and prio > request.priority
        )
        if ahead:
            notes.append(f"priority: {ahead} higher-priority {request.mode} requests wait ahead of it")
        over = self.quotas.borrowing_level(request.project, demand_milli(request, self.timeslice_milli))
        if over is not None:
            notes.append(f"{node_label(over)} is over its guarantee, so it may only borrow idle capacity")
        return "; ".join(notes)


def _fit_shape(request: Request) -> FitShape:
    """What decides where a request fits: the fields of its sharing mode (a dedicated
    request's MIG profile means nothing) and what it needs of the host."""
    host = (request.cpu_milli, request.memory_mib, request.isolation, request.gpu_models)
    if request.mode == DEDICATED:
        return (DEDICATED, request.gpu_count, "", 0, 0, *host)
    if request.mode == MIG:
        return (MIG, 1, request.mig_profile, 0, 0, *host)
    if request.mode == MPS:
        return (MPS, 1, "", request.mps_memory_mib, request.mps_thread_pct, *host)
    return (request.mode, 1, "", 0, 0, *host)


def _fit_kind(
    request: Request, hidden: bool
) -> tuple[tuple[str, str, str, tuple[str, ...], bool], tuple[int, ...]]:
    """What a request needs, split into what must match (its kind) and sizes that only
    need to be at least as large for it to fail where a smaller one failed."""
    kind = (request.mode, request.mig_profile, request.isolation, request.gpu_models, hidden)
    sizes = (
        request.gpu_count,
        request.mps_thread_pct,
        request.mps_memory_mib,
        request.cpu_milli,
        request.memory_mib,
    )
    return kind, sizes


def _device(grant: DeviceGrant) -> str:
    """The device a grant takes: its MIG instance, else its GPU."""
    return grant.mig_uuid or grant.gpu_uuid


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")
