"""The control worker's scheduling cycle: snapshot the database, ask the pure scheduler,
commit its decisions. One transaction per cycle, and one cycle at a time: on PostgreSQL
``schedule_once`` takes an advisory lock (see ``_claim_cycle``); on SQLite the control
worker's task holds a Redis lock (workers/control.py)."""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Prefetch, Q
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.catalog.models import SharingMode
from portal.fleet.models import Gpu, Host
from portal.fleet.plans import running_plan_gpus
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.actions import SandboxRequest
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from scheduler.cluster import (
    AUTO,
    DEDICATED,
    MIG,
    MPS,
    TIMESLICE,
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
    Running,
    Snapshot,
)
from scheduler.cycle import run_cycle
from scheduler.fairshare import decayed_usage
from scheduler.placement import get_policy
from workers.drivers import DRIVER_ISOLATION

log = logging.getLogger(__name__)
S = SandboxState
HOLDING = (S.PLACING, S.STARTING, S.RUNNING, S.STOPPING)  # states whose devices are booked
PREEMPTIBLE_STATES = (S.PLACING, S.STARTING, S.RUNNING)
# pg_advisory_xact_lock(namespace, key) of the cycle; "GPSC", beside billing's "GPS\0".
CYCLE_LOCK_KEY = (0x47505343, 0)


def _grant(a: Allocation) -> DeviceGrant:
    return DeviceGrant(
        gpu_uuid=a.gpu.uuid,
        device_uuid=a.device_uuid,
        kind=a.kind,
        milli_gpu=a.milli_gpu,
        mig_uuid=a.mig_instance.uuid if a.mig_instance else "",
        mps_memory_mib=a.mps_memory_mib,
        mps_thread_pct=a.mps_thread_pct,
        replica=a.replica,
    )


def _live_allocations() -> list[Allocation]:
    """Every device held now: only sandboxes in HOLDING states have active allocations."""
    return list(
        Allocation.objects.filter(active=True).select_related(
            "gpu", "mig_instance", "sandbox__project", "sandbox__host", "sandbox__tier__priority_class"
        )
    )


def _running(live: list[Allocation]) -> list[Running]:
    """Every placed sandbox still holding devices, with what preemption needs to know."""
    by_sandbox: dict[int, list[Allocation]] = defaultdict(list)
    for alloc in live:
        by_sandbox[alloc.sandbox_id].append(alloc)
    running = []
    for allocs in by_sandbox.values():
        sandbox = allocs[0].sandbox
        started = sandbox.started_at or sandbox.placed_at or sandbox.requested_at
        priority_class = sandbox.tier.priority_class
        running.append(
            Running(
                sandbox_id=sandbox.pk,
                project=sandbox.project.slug,
                host=sandbox.host.name if sandbox.host else "",
                grants=tuple(_grant(a) for a in allocs),
                priority=priority_class.value,
                started_at=started.timestamp(),
                ends_at=(started + sandbox.max_duration).timestamp(),
                preemptible=priority_class.preemptible and sandbox.state in PREEMPTIBLE_STATES,
                borrowed=sandbox.borrowed,
                cpu_milli=_cpu_milli(sandbox.tier.cpu_limit),
                memory_mib=sandbox.tier.memory_limit_mib,
            )
        )
    return running


def _cpu_milli(cores: float) -> int:
    return round(cores * 1000)


def build_snapshot() -> Snapshot:
    live = _live_allocations()
    held: dict[int, list[Allocation]] = defaultdict(list)
    for alloc in live:
        held[alloc.gpu_id].append(alloc)
    busy_mig = {a.mig_instance_id for allocs in held.values() for a in allocs if a.mig_instance_id}
    # GPUs a defragmentation plan is changing take nothing new until it is done.
    planned = running_plan_gpus()
    hosts = []
    for host in Host.objects.prefetch_related(
        Prefetch("gpus", queryset=Gpu.objects.prefetch_related("mig_instances"))
    ):
        gpus = []
        for gpu in host.gpus.all():
            allocs = held.get(gpu.pk, [])
            gpus.append(
                GpuState(
                    uuid=gpu.uuid,
                    host=host.name,
                    index=gpu.index,
                    model=gpu.model,
                    memory_mib=gpu.memory_mib,
                    mode=gpu.sharing_mode,
                    available=gpu.state == Gpu.State.AVAILABLE and gpu.uuid not in planned,
                    exclusive_busy=any(a.kind == Allocation.Kind.EXCLUSIVE for a in allocs),
                    mig=[
                        MigSlot(m.uuid, m.profile, m.start, m.memory_slices, busy=m.pk in busy_mig)
                        for m in gpu.mig_instances.all()
                    ],
                    mps_used_mib=sum(a.mps_memory_mib for a in allocs),
                    mps_used_threads=sum(a.mps_thread_pct for a in allocs),
                    # Following demand it may become time-sliced: it offers its replicas too.
                    replicas=gpu.timeslice_replicas if gpu.sharing_mode in (TIMESLICE, AUTO) else 0,
                    replicas_used={a.replica for a in allocs if a.replica is not None},
                )
            )
        hosts.append(
            HostState(
                name=host.name,
                up=host.state == Host.State.UP,
                gpus=gpus,
                cpu_milli=host.cpu_cores * 1000,  # 0 until its agent reports: not tracked
                memory_mib=host.memory_mib,
                isolation_levels=(DRIVER_ISOLATION[host.driver],) if host.driver in DRIVER_ISOLATION else (),
            )
        )
    running = _running(live) + _cpu_only_running()
    by_name = {h.name: h for h in hosts}
    for holder in running:  # what placed sandboxes already take of each host
        if holder.host in by_name:
            by_name[holder.host].take(holder.cpu_milli, holder.memory_mib)
    return Snapshot(hosts=hosts, running=running)


def _cpu_only_running() -> list[Running]:
    """Placed CPU-only sandboxes: they hold no allocation, yet take their host's CPU and
    memory, which the snapshot must count or the host is over-committed."""
    placed = Sandbox.objects.filter(
        state__in=HOLDING, host__isnull=False, tier__sharing_mode=SharingMode.CPU
    ).values_list(
        "pk", "project__slug", "host__name", "state", "borrowed", "max_duration",
        "started_at", "placed_at", "requested_at", "tier__cpu_limit", "tier__memory_limit_mib",
        "tier__priority_class__value", "tier__priority_class__preemptible",
    )  # fmt: skip
    running = []
    for pk, project, host, state, borrowed, length, *times, cpu, memory, priority, preemptible in placed:
        started = next(t for t in times if t is not None)  # requested_at is always set
        running.append(
            Running(
                sandbox_id=pk,
                project=project,
                host=host,
                grants=(),
                priority=priority,
                started_at=started.timestamp(),
                ends_at=(started + length).timestamp(),
                preemptible=preemptible and state in PREEMPTIBLE_STATES,
                borrowed=borrowed,
                cpu_milli=_cpu_milli(cpu),
                memory_mib=memory,
            )
        )
    return running


def build_queue() -> list[Request]:
    """Queued requests, less those waiting for the victims they preempted to stop."""
    waiting = Sandbox.objects.filter(state=S.STOPPING, preempted_for__isnull=False).values("preempted_for")
    queued = (
        Sandbox.objects.filter(state=S.QUEUED)
        .exclude(pk__in=waiting)
        .select_related("tier__priority_class", "project")
    )
    return [scheduler_request(s.pk, s, s.requested_at.timestamp()) for s in queued]


def scheduler_request(request_id: int, asked: Sandbox | SandboxRequest, submitted_at: float) -> Request:
    """What the scheduler sees of a sandbox request, queued or only previewed."""
    tier = asked.tier
    mode = tier.sharing_mode
    asked_for = asked.max_duration if isinstance(asked, Sandbox) else asked.duration
    max_duration = asked_for or tier.max_duration
    return Request(
        id=request_id,
        project=asked.project.slug,
        priority=tier.priority_class.value,
        submitted_at=submitted_at,
        mode=mode,
        gpu_count=asked.gpu_count if mode == DEDICATED else 1,
        mig_profile=asked.mig_profile if mode == MIG else "",
        mps_memory_mib=asked.mps_memory_mib if mode == MPS else 0,
        mps_thread_pct=asked.mps_thread_pct if mode == MPS else 0,
        max_duration_s=max_duration.total_seconds(),
        cpu_milli=_cpu_milli(tier.cpu_limit),
        memory_mib=tier.memory_limit_mib,
        isolation=asked.isolation,
    )


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
    for quota in QuotaPolicy.objects.select_related("project"):
        slug = quota.project.slug
        projects[slug] = ProjectShare(
            weight=quota.weight,
            guaranteed_milli=int(quota.guaranteed_gpus * 1000) or None,
            limit_milli=quota.max_gpus * 1000,
            usage_gpu_s=decayed_usage(intervals.pop(slug, []), now, half_life_s),
        )
    for slug, spans in intervals.items():  # projects without a policy: default weight, no limits
        projects[slug] = ProjectShare(usage_gpu_s=decayed_usage(spans, now, half_life_s))
    return FairShareState(projects=projects, half_life_s=half_life_s)


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
    the request is placed by a later cycle. Messages leave only after commit.
    """
    placed = pending = 0
    with transaction.atomic():
        if not _claim_cycle():  # first, so the snapshot is read under the lock
            log.info("scheduling cycle skipped: another cycle holds the database lock")
            return 0, 0
        queue = build_queue()
        if not queue:
            return 0, 0
        policy = get_policy(policy_name or settings.SCHEDULER_POLICY)
        decisions = run_cycle(build_snapshot(), queue, policy, now, fairshare=build_fairshare(now))
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
                reason = (
                    f"starting once preempted sandbox {', '.join(map(str, stopped))} has stopped"
                    if stopped
                    else "waiting for capacity to free up"
                )
                actions.do_set_pending_reason(decision.request_id, reason)
                victims = []
                pending += 1
            elif isinstance(decision, Place):
                if actions.do_place(decision.request_id, decision.host, decision.grants, decision.borrowed):
                    placed += 1
            elif isinstance(decision, Pending):
                actions.do_set_pending_reason(decision.request_id, decision.reason)
                pending += 1
    if placed:
        log.info("scheduling cycle placed %d, %d pending", placed, pending)
    return placed, pending
