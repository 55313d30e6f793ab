"""The control worker's scheduling cycle: read the database, ask the pure scheduler, write
what changed, publish the state it left.

One transaction per cycle, and one cycle at a time: on PostgreSQL ``schedule_once`` takes
an advisory lock (see ``_claim_cycle``); on SQLite the control worker's task holds a Redis
lock (workers/control.py).

Built to hold at the openb cluster's size (1,213 hosts, 6,212 GPUs, ~7,000 sandboxes
running, 1,000 waiting; tests/bench/test_portal_cycle.py):

- **reading** is plain ``values_list`` queries: no model instances, no prefetch objects;
- **deciding** uses a placement policy kept between cycles (``portal/sandboxes/policy.py``):
  its memoised scores survive the tick and its workload model learns from recent requests;
- **writing** is only what changed: a pending reason is written when it differs from the
  stored one, so a cycle in which nothing changed writes nothing;
- after commit the cycle **publishes** the state its decisions left
  (``portal/sandboxes/digest.py``), from which the request form's preview answers.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.fleet.models import Gpu, Host, MigInstance
from portal.fleet.plans import running_plan_gpus
from portal.gc_pause import collection_paused
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions, digest, policy
from portal.sandboxes.actions import SandboxRequest
from portal.sandboxes.models import PENDING_REASON_MAX, Allocation, Sandbox, SandboxState
from scheduler.cluster import (
    AUTO,
    DEDICATED,
    MIG,
    MPS,
    TIMESLICE,
    Decision,
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    MigSlot,
    Pending,
    Place,
    Preempt,
    ProjectShare,
    Request,
    Reserve,
    Running,
    Snapshot,
)
from scheduler.cycle import revert, run_cycle
from scheduler.fairshare import decayed_usage
from workers.drivers import DRIVER_ISOLATION

log = logging.getLogger(__name__)
S = SandboxState
HOLDING = (S.PLACING, S.STARTING, S.RUNNING, S.STOPPING)  # states whose devices are booked
PREEMPTIBLE_STATES = (S.PLACING, S.STARTING, S.RUNNING)
# pg_advisory_xact_lock(namespace, key) of the cycle; "GPSC", beside billing's "GPS\0".
CYCLE_LOCK_KEY = (0x47505343, 0)


# --- reading the fleet --------------------------------------------------------------------


def offered_replicas(sharing_mode: str, timeslice_replicas: int) -> int:
    """The time-slice replicas a GPU offers: those of one that is, or may become (following
    demand, ``auto``), time-sliced; none otherwise. The database's modes are the
    scheduler's names, so the mode itself passes straight through."""
    return timeslice_replicas if sharing_mode in (TIMESLICE, AUTO) else 0


def _cpu_milli(cores: float) -> int:
    return round(cores * 1000)


@dataclass
class _Held:
    """What the live allocations on one GPU take of it."""

    exclusive: bool = False
    mps_mib: int = 0
    mps_threads: int = 0
    replicas: set[int] = field(default_factory=set)


def _live_grants(
    gpu_uuids: dict[int, str], mig_uuids: dict[int, str]
) -> tuple[dict[int, list[DeviceGrant]], dict[int, _Held], set[int]]:
    """Every device held now, by sandbox; what is held of each GPU; the MIG instances held."""
    by_sandbox: dict[int, list[DeviceGrant]] = defaultdict(list)
    by_gpu: dict[int, _Held] = defaultdict(_Held)
    busy_mig: set[int] = set()
    rows = Allocation.objects.filter(active=True).order_by("pk")
    for sandbox_id, gpu_id, mig_id, device, kind, milli, mps_mib, mps_threads, replica in rows.values_list(
        "sandbox_id", "gpu_id", "mig_instance_id", "device_uuid", "kind", "milli_gpu",
        "mps_memory_mib", "mps_thread_pct", "replica",
    ):  # fmt: skip
        # An instance destroyed by a re-layout leaves its allocations without one (SET_NULL).
        mig_uuid = mig_uuids.get(mig_id, "") if mig_id is not None else ""
        by_sandbox[sandbox_id].append(
            DeviceGrant(gpu_uuids[gpu_id], device, kind, milli, mig_uuid, mps_mib, mps_threads, replica)
        )
        held = by_gpu[gpu_id]
        held.exclusive = held.exclusive or kind == Allocation.Kind.EXCLUSIVE
        held.mps_mib += mps_mib
        held.mps_threads += mps_threads
        if replica is not None:
            held.replicas.add(replica)
        if mig_id is not None:
            busy_mig.add(mig_id)
    return by_sandbox, by_gpu, busy_mig


def _running(grants: dict[int, list[DeviceGrant]]) -> list[Running]:
    """Every placed sandbox still holding its host's resources, with what preemption needs.

    From the sandboxes in a holding state, not from the allocations: a sandbox that holds
    no device (a CPU-only one) still takes its tier's CPU and memory on its host.
    """
    running = []
    # Its start as the scheduler counts it, read as one value (each datetime costs a parse).
    started = Coalesce("started_at", "placed_at", "requested_at")
    rows = Sandbox.objects.filter(state__in=HOLDING).annotate(start=started).order_by("pk")
    for (
        pk, project, host, state, priority, preemptible, cpu_cores, memory_mib, borrowed, start,
        max_duration,
    ) in rows.values_list(
        "pk", "project__slug", "host__name", "state", "tier__priority_class__value",
        "tier__priority_class__preemptible", "tier__cpu_limit", "tier__memory_limit_mib", "borrowed",
        "start", "max_duration",
    ):  # fmt: skip
        held = tuple(grants.get(pk, ()))
        if host is None and not held:
            continue  # holds nothing anywhere
        running.append(
            Running(
                sandbox_id=pk,
                project=project,
                host=host or "",
                grants=held,
                priority=priority,
                started_at=start.timestamp(),
                ends_at=(start + max_duration).timestamp(),
                preemptible=preemptible and state in PREEMPTIBLE_STATES,
                borrowed=borrowed,
                cpu_milli=_cpu_milli(cpu_cores),
                memory_mib=memory_mib,
            )
        )
    return running


def build_snapshot() -> Snapshot:
    """Every host and GPU, what is free on them and who holds the rest."""
    gpu_rows = list(
        Gpu.objects.order_by("host_id", "index").values_list(
            "pk", "host_id", "index", "uuid", "model", "memory_mib", "sharing_mode", "timeslice_replicas",
            "state",
        )
    )  # fmt: skip
    mig_rows = list(
        MigInstance.objects.order_by("gpu_id", "start").values_list(
            "pk", "gpu_id", "uuid", "profile", "start", "memory_slices"
        )
    )
    gpu_uuids = {row[0]: row[3] for row in gpu_rows}
    grants, held, busy_mig = _live_grants(gpu_uuids, {row[0]: row[2] for row in mig_rows})
    slots: dict[int, list[MigSlot]] = defaultdict(list)
    for pk, gpu_id, uuid, profile, start, memory_slices in mig_rows:
        slots[gpu_id].append(MigSlot(uuid, profile, start, memory_slices, busy=pk in busy_mig))
    # GPUs a defragmentation plan is changing take nothing new until it is done.
    planned = running_plan_gpus()
    hosts = list(
        Host.objects.order_by("name").values_list(
            "pk", "name", "state", "cpu_cores", "memory_mib", "driver", "backend"
        )
    )
    names = {pk: name for pk, name, *_ in hosts}
    # A VM cannot take a real GPU yet (the libvirt driver refuses passthrough, see
    # docs/gpu-hosts.md): such a host offers its CPU and memory only, so a GPU request for a
    # VM waits instead of being placed where its launch can only fail.
    no_gpus = {pk for pk, *_, driver, backend in hosts if driver == "libvirt" and backend != "simulated"}
    gpus: dict[int, list[GpuState]] = defaultdict(list)
    for pk, host_id, index, uuid, model, memory_mib, sharing_mode, replicas, state in gpu_rows:
        used = held.get(pk) or _Held()
        gpus[host_id].append(
            GpuState(
                uuid=uuid,
                host=names.get(host_id, ""),
                index=index,
                model=model,
                memory_mib=memory_mib,
                mode=sharing_mode,
                available=state == Gpu.State.AVAILABLE and uuid not in planned,
                exclusive_busy=used.exclusive,
                mig=slots.get(pk, []),
                mps_used_mib=used.mps_mib,
                mps_used_threads=used.mps_threads,
                replicas=offered_replicas(sharing_mode, replicas),
                replicas_used=set(used.replicas),
            )
        )
    states = [
        HostState(
            name=name,
            up=state == Host.State.UP,
            gpus=[] if pk in no_gpus else gpus.get(pk, []),
            cpu_milli=cpu_cores * 1000,  # 0 until its agent reports: not tracked
            memory_mib=memory_mib,
            isolation_levels=(DRIVER_ISOLATION[driver],) if driver in DRIVER_ISOLATION else (),
        )
        for pk, name, state, cpu_cores, memory_mib, driver, _backend in hosts
    ]
    running = _running(grants)
    by_name = {h.name: h for h in states}
    for holder in running:  # what placed sandboxes already take of each host
        if holder.host in by_name:
            by_name[holder.host].take(holder.cpu_milli, holder.memory_mib)
    return Snapshot(hosts=states, running=running)


# --- reading the queue --------------------------------------------------------------------


@dataclass(frozen=True)
class Queued:
    """A waiting request, with what the cycle needs besides the scheduler's view of it."""

    request: Request
    reason: str  # the pending reason stored now: rewritten only when the cycle's differs
    preemptible: bool  # once placed, whether its priority class lets it be preempted


def _request(
    request_id: int,
    *,
    project: str,
    priority: int,
    submitted_at: float,
    mode: str,
    gpu_count: int,
    mig_profile: str,
    mps_memory_mib: int,
    mps_thread_pct: int,
    max_duration: timedelta,
    cpu_cores: float,
    memory_mib: int,
    isolation: str,
) -> Request:
    """What the scheduler sees of a request: only the fields of its tier's sharing mode."""
    return Request(
        id=request_id,
        project=project,
        priority=priority,
        submitted_at=submitted_at,
        mode=mode,
        gpu_count=gpu_count if mode == DEDICATED else 1,
        mig_profile=mig_profile if mode == MIG else "",
        mps_memory_mib=mps_memory_mib if mode == MPS else 0,
        mps_thread_pct=mps_thread_pct if mode == MPS else 0,
        max_duration_s=max_duration.total_seconds(),
        cpu_milli=_cpu_milli(cpu_cores),
        memory_mib=memory_mib,
        isolation=isolation,
    )


def read_queue() -> list[Queued]:
    """Queued requests, less those waiting for the victims they preempted to stop."""
    waiting = Sandbox.objects.filter(state=S.STOPPING, preempted_for__isnull=False).values("preempted_for")
    rows = Sandbox.objects.filter(state=S.QUEUED).exclude(pk__in=waiting).order_by("requested_at", "pk")
    queued = []
    for (
        pk, project, priority, preemptible, requested_at, mode, gpu_count, mig_profile, mps_mib, mps_threads,
        asked_for, tier_max, cpu_cores, memory_mib, isolation, reason,
    ) in rows.values_list(
        "pk", "project__slug", "tier__priority_class__value", "tier__priority_class__preemptible",
        "requested_at", "tier__sharing_mode", "gpu_count", "mig_profile", "mps_memory_mib", "mps_thread_pct",
        "max_duration", "tier__max_duration", "tier__cpu_limit", "tier__memory_limit_mib", "isolation",
        "pending_reason",
    ):  # fmt: skip
        request = _request(
            pk, project=project, priority=priority, submitted_at=requested_at.timestamp(), mode=mode,
            gpu_count=gpu_count, mig_profile=mig_profile, mps_memory_mib=mps_mib, mps_thread_pct=mps_threads,
            max_duration=asked_for or tier_max, cpu_cores=cpu_cores, memory_mib=memory_mib,
            isolation=isolation,
        )  # fmt: skip
        queued.append(Queued(request, reason, preemptible))
    return queued


def build_queue() -> list[Request]:
    """The requests the next cycle decides for."""
    return [q.request for q in read_queue()]


def scheduler_request(request_id: int, asked: SandboxRequest, submitted_at: float) -> Request:
    """What the scheduler would see of a request being written (the form's preview)."""
    tier = asked.tier
    return _request(
        request_id, project=asked.project.slug, priority=tier.priority_class.value, submitted_at=submitted_at,
        mode=tier.sharing_mode, gpu_count=asked.gpu_count, mig_profile=asked.mig_profile,
        mps_memory_mib=asked.mps_memory_mib, mps_thread_pct=asked.mps_thread_pct,
        max_duration=asked.duration or tier.max_duration, cpu_cores=tier.cpu_limit,
        memory_mib=tier.memory_limit_mib, isolation=asked.isolation,
    )  # fmt: skip


def build_fairshare(now: float) -> FairShareState:
    """Weights and quotas from QuotaPolicy; usage decayed from the ledger's intervals."""
    half_life_s = settings.FAIRSHARE_HALF_LIFE_H * 3600.0
    since = timezone.now() - timedelta(seconds=half_life_s * 6)  # older usage weighs < 2%
    intervals: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for slug, start, end, milli in UsageRecord.objects.filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=since)
    ).values_list("project__slug", "started_at", "ended_at", "milli_gpu"):
        intervals[slug].append((start.timestamp(), end.timestamp() if end else now, milli))
    projects = {}
    for slug, weight, guaranteed, max_gpus in QuotaPolicy.objects.values_list(
        "project__slug", "weight", "guaranteed_gpus", "max_gpus"
    ):
        projects[slug] = ProjectShare(
            weight=weight,
            guaranteed_milli=int(guaranteed * 1000) or None,
            limit_milli=max_gpus * 1000,
            usage_gpu_s=decayed_usage(intervals.pop(slug, []), now, half_life_s),
        )
    for slug, spans in intervals.items():  # projects without a policy: default weight, no limits
        projects[slug] = ProjectShare(usage_gpu_s=decayed_usage(spans, now, half_life_s))
    return FairShareState(projects=projects, half_life_s=half_life_s)


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
            decisions = run_cycle(snapshot, requests, kept, now, fairshare=fairshare, in_place=True)
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
                if actions.do_preempt(v.sandbox_id, decision.request_id, v.reason)
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
            holders[victim_id] = replace(holders[victim_id], preemptible=False)  # stopping now
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
                cpu_milli=q.request.cpu_milli,
                memory_mib=q.request.memory_mib,
            )
        elif isinstance(decision, Pending | Place) and decision.request_id not in deferred:
            waiting.append(queued[decision.request_id].request)
    snapshot.running = list(holders.values())
    return snapshot.running, waiting
