"""The control worker's scheduling cycle: read the database, ask the pure scheduler, write
what changed, publish the state it left.

One transaction per cycle, and one cycle at a time: on PostgreSQL ``schedule_once`` takes
an advisory lock (see ``_claim_cycle``); elsewhere (SQLite, the embedded deployment)
``schedule_cycle`` holds a Redis lock around it.

Built to hold at the openb cluster's size (1,213 hosts, 6,212 GPUs, ~7,000 sandboxes
running, 1,000 waiting; tests/bench/test_portal_cycle.py):

- **reading** is plain ``values_list`` queries (``portal.scheduling.snapshot``);
- **deciding** uses a placement policy kept between cycles (``portal/scheduling/policy.py``):
  its memoised scores survive the tick and its workload model learns from recent requests;
- **writing** is only what changed: a pending reason is written when it differs from the
  stored one, so a cycle in which nothing changed writes nothing;
- after commit the cycle **publishes** the state its decisions left
  (``portal/scheduling/digest.py``), from which the request form's preview answers.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Sum

from portal.control.redis_client import client as redis_client
from portal.fleet.models import Gpu, Host, MigInstance, running_plan_gpus
from portal.sandboxes import actions, nudge, preemption
from portal.sandboxes.models import PENDING_REASON_MAX, Allocation, Sandbox
from portal.scheduling import digest, policy
from portal.scheduling.snapshot import HOLDING, Queued, build_fairshare, build_snapshot, read_queue
from portal.telemetry import control_figures
from scheduler.cluster import Decision, Pending, Place, Preempt, Request, Reserve, Running, Snapshot
from scheduler.cycle import revert, run_cycle
from scheduler.gc_pause import collection_paused

log = logging.getLogger(__name__)
# pg_advisory_xact_lock(namespace, key) of the cycle; "GPSC", beside billing's "GPS\0".
CYCLE_LOCK_KEY = (0x47505343, 0)
# The Redis lock that keeps cycles apart where the database has no advisory lock.
CYCLE_LOCK = "gpushare:lock:scheduling-cycle"


def schedule_cycle(now: float) -> None:
    """Run one cycle unless another worker is running one (it will see our queue too).

    On PostgreSQL ``schedule_once`` alone decides, with a transaction-scoped advisory lock:
    it costs a second worker one query, and it dies with a killed worker's connection. A
    Redis lock in front of it would outlive a worker killed mid-cycle and hold every cycle
    off until it expired (60 s), which the fault tests saw. Other databases (SQLite in the
    embedded deployment, one control process with a thread pool) have no such lock, so a
    Redis one serialises the cycles there."""
    if connection.vendor == "postgresql":
        schedule_once(now)
        return
    lock = redis_client().lock(CYCLE_LOCK, timeout=60, blocking=False)
    if not lock.acquire():
        return
    try:
        schedule_once(now)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:  # expired meanwhile: the cycle committed all the same
            log.warning("the scheduling cycle outlived its Redis lock (%s s)", lock.timeout)


# --- the cycle ----------------------------------------------------------------------------


@dataclass
class CycleReport:
    """What the last cycle of this process did and where its time went (seconds by part:
    queue, snapshot, fairshare, learn, decide, commit, encode, launch, publish)."""

    placed: int = 0
    launches: list[int] = field(default_factory=list)  # the sandboxes placed, to launch after commit
    pending: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - began

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


last_report = CycleReport()


def _claim_cycle() -> bool:
    """Take the cycle's transaction-scoped advisory lock; False when another cycle holds it.

    Two cycles at once would decide from snapshots that do not see each other's bookings
    (MPS shares have no constraint to catch that). A Redis lock cannot promise this: it
    expires, a Redis restart forgets it, and one held by a killed worker blocks until it
    expires. PostgreSQL releases this lock when the cycle's transaction ends or its
    connection dies. Not waiting is safe: the holder's cycle, or the next tick's, sees the
    queue. SQLite (the embedded single-process deployment) serialises writers anyway, and
    the control worker's Redis lock keeps its threads' cycles apart.
    """
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", list(CYCLE_LOCK_KEY))
        row = cursor.fetchone()
    return bool(row and row[0])


def schedule_once(now: float, policy_name: str | None = None) -> tuple[int, int]:
    """One cycle in one transaction; returns (placed, pending), (0, 0) when another cycle
    holds the advisory lock (it is skipped, not queued behind: see ``_claim_cycle``).

    Each placement runs in its own savepoint (inside ``do_place``): one refused by a
    database constraint rolls back alone and its sandbox stays queued for the next cycle.
    A Place that needs preempted victims is not applied now: the victims stop first and
    the request is placed by a later cycle. Messages leave, and the state the cycle left
    is published for the preview, only after commit.
    """
    global last_report
    report = CycleReport()
    name = policy_name or settings.SCHEDULER_POLICY
    body: bytes | None = None
    with collection_paused(), transaction.atomic():
        if not _claim_cycle():  # first, so the snapshot is read under the lock
            log.info("scheduling cycle skipped: another cycle holds the database lock")
            return 0, 0
        nudge.cycle_begins()  # a request committed from here on asks for the next cycle
        with report.timing("queue"):
            queued = read_queue()
        # An empty queue has nothing to decide, but the preview's state still ages, and the
        # fleet under it changes (hosts join, GPUs drain, sandboxes end).
        fleet = "" if queued else fleet_fingerprint()
        if queued or digest.idle_refresh_due(fleet):
            body = _decide_and_commit(queued, now, name, report)
    if report.launches:
        # Every placement of the cycle in one transaction, after the cycle's commit (a
        # transaction each cost 5 ms apiece, 0.75 s for 155 at the cluster's size).
        with report.timing("launch"):
            actions.do_send_launches(sorted(report.launches))
    if body is not None:
        with report.timing("publish"):
            digest.publish(body, fleet)
    last_report = report
    if body is not None and queued:
        control_figures.record(
            redis_client(), control_figures.CYCLE, int(time.time() * 1000), report.total_s * 1000
        )
    if report.placed:
        log.info("scheduling cycle placed %d, %d pending", report.placed, report.pending)
    if report.total_s > settings.CYCLE_INTERVAL_S:
        split = ", ".join(f"{part} {s:.2f}" for part, s in report.seconds.items())
        log.warning("scheduling cycle took %.2f s, longer than its interval (%s)", report.total_s, split)
    return report.placed, report.pending


def fleet_fingerprint() -> str:
    """A few aggregates that change whenever what ``build_snapshot`` would read does: the
    hosts and their state, the GPUs' state and mode, the MIG instances, who holds devices
    and which sandboxes hold a host. Sums of primary keys tell one set from another of the
    same size. Milliseconds at the cluster's size, against a snapshot's hundreds."""
    parts: list[Any] = [
        list(
            Host.objects.values_list("state")
            .annotate(n=Count("pk"), keys=Sum("pk"), cpu=Sum("cpu_cores"), mem=Sum("memory_mib"))
            .order_by("state")
        ),
        list(
            Gpu.objects.values_list("state", "sharing_mode")
            .annotate(n=Count("pk"), keys=Sum("pk"), replicas=Sum("timeslice_replicas"))
            .order_by("state", "sharing_mode")
        ),
        MigInstance.objects.aggregate(n=Count("pk"), keys=Sum("pk")),
        Allocation.objects.filter(active=True).aggregate(n=Count("pk"), keys=Sum("pk")),
        list(
            Sandbox.objects.filter(state__in=HOLDING, host__isnull=False)
            .values_list("state")
            .annotate(n=Count("pk"), keys=Sum("pk"))
            .order_by("state")
        ),
        sorted(running_plan_gpus()),
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def _decide_and_commit(queued: list[Queued], now: float, name: str, report: CycleReport) -> bytes:
    """Decide for the queue, commit, and encode the state left for the preview."""
    requests = [q.request for q in queued]
    with report.timing("snapshot"):
        fresh = build_snapshot()
    with report.timing("fairshare"):
        fairshare = build_fairshare(now)
    by_id = {q.request.id: q for q in queued}
    with policy.lock:  # the kept policy and fleet, until the state is encoded
        with report.timing("learn"):
            kept = policy.kept_policy(name)
            policy.learn(kept, requests)
        with report.timing("decide"):
            snapshot = policy.kept_fleet(fresh)
            # In place: the kept fleet ends the cycle with its decisions applied, and is
            # then brought to what was committed.
            decisions = run_cycle(
                snapshot, requests, kept, now, fairshare=fairshare, in_place=True,
                backfill_window_s=settings.BACKFILL_WINDOW_S,
            )  # fmt: skip
        with report.timing("commit"):
            placed, deferred = _commit(decisions, by_id, report)
        with report.timing("encode"):
            running, pending = _as_committed(snapshot, decisions, by_id, placed, deferred, time.time())
            model = policy.workload_of(kept)
            return digest.encode(
                snapshot=snapshot, running=running, pending=pending,
                reservation=next((d for d in reversed(decisions) if isinstance(d, Reserve)), None),
                fairshare=fairshare, now=now, policy=name,
                typical=model.typical if model else [],
                multi_gpu_share=model.multi_gpu_share if model else 0.0,
                multi_gpu=model.multi_gpu if model else [],
            )  # fmt: skip


def _commit(
    decisions: list[Decision], queued: dict[int, Queued], report: CycleReport
) -> tuple[set[int], dict[int, list[int]]]:
    """Write the decisions; returns the requests placed, and those left waiting for the
    victims stopped for them (by request). Of the reasons to wait, only those that differ
    from the stored ones are written."""
    placed: set[int] = set()
    deferred: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    victims: list[Preempt] = []
    for decision in decisions:
        if isinstance(decision, Preempt):
            victims.append(decision)
        elif isinstance(decision, Place) and victims:
            stopped = [
                v.sandbox_id
                for v in victims
                if preemption.do_preempt(v.sandbox_id, decision.request_id, v.reason)
            ]
            reasons[decision.request_id] = (
                f"starting once preempted sandbox {', '.join(map(str, stopped))} has stopped"
                if stopped
                else "waiting for capacity to free up"
            )
            if stopped:  # it waits for them out of the queue; with none stopped it stays in it
                deferred[decision.request_id] = stopped
            victims = []
            report.pending += 1
        elif isinstance(decision, Place):
            if actions.do_place(
                decision.request_id, decision.host, decision.grants, decision.borrowed, launch=False
            ):
                placed.add(decision.request_id)
                report.placed += 1
                report.launches.append(decision.request_id)
        elif isinstance(decision, Pending):
            reasons[decision.request_id] = decision.reason
            report.pending += 1
    actions.do_set_pending_reasons(
        {pk: why for pk, why in reasons.items() if queued[pk].reason != why[:PENDING_REASON_MAX]}
    )
    return placed, deferred


def _as_committed(
    snapshot: Snapshot,
    decisions: list[Decision],
    queued: dict[int, Queued],
    placed: set[int],
    deferred: dict[int, list[int]],
    placed_at: float,
) -> tuple[list[Running], list[Request]]:
    """Bring the fleet the cycle decided on (in place) to what was committed.

    The cycle booked every Place and released every victim; in the database a Place after
    victims is not applied (the victims keep their devices while they stop, no longer
    preemptible) and neither is a Place that ``do_place`` refused: both are reverted.
    Returns who holds devices now and the requests still waiting, in the order the cycle
    took them.
    """
    undone: list[Decision] = []
    victims: list[Decision] = []
    for decision in decisions:
        if isinstance(decision, Preempt):
            victims.append(decision)
        elif isinstance(decision, Place):
            if decision.request_id not in placed:
                undone += [*victims, decision]
            victims = []
    revert(snapshot, undone, [q.request for q in queued.values()])
    holders = {r.sandbox_id: r for r in snapshot.running}
    for stopped in deferred.values():
        for victim_id in stopped:
            # Stopping (or warned) now: no one's victim again.
            holders[victim_id] = replace(holders[victim_id], preemptible=False, preemptible_at=math.inf)
    waiting: list[Request] = []
    for decision in decisions:
        if isinstance(decision, Place) and decision.request_id in placed:
            q = queued[decision.request_id]
            duration = q.request.max_duration_s
            holders[decision.request_id] = Running(
                sandbox_id=decision.request_id,
                project=q.request.project,
                host=decision.host,
                grants=decision.grants,
                priority=q.request.priority,
                started_at=placed_at,
                ends_at=placed_at + duration if duration > 0 else None,
                preemptible=q.preemptible,
                borrowed=decision.borrowed,
                preemptible_at=placed_at + q.preempt_after_s,
                warning_s=q.warning_s,
                cpu_milli=q.request.cpu_milli,
                memory_mib=q.request.memory_mib,
            )
        elif isinstance(decision, Pending | Place) and decision.request_id not in deferred:
            waiting.append(queued[decision.request_id].request)
    snapshot.running = list(holders.values())
    return snapshot.running, waiting
