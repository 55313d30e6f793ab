"""The database as the scheduler sees it: the fleet (``build_snapshot``), the queue
(``read_queue``/``build_queue``), fair share (``build_fairshare``) and a request being
written (``scheduler_request``).

Read by the scheduling cycle (``portal.control.scheduling``) and by the request form's
preview (``portal.scheduling.preview``). Built to hold at the openb cluster's size (1,213
hosts, 6,212 GPUs, ~7,000 sandboxes running, 1,000 waiting; tests/bench/test_portal_cycle.py):
reading is plain ``values_list`` queries, no model instances, no prefetch objects.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.fleet.models import SIMULATED_BACKENDS, Gpu, Host, MigInstance, running_plan_gpus
from portal.quotas.models import Department, ModelQuota, QuotaPolicy
from portal.quotas.usage import model_hours_used_up
from portal.sandboxes.actions import SandboxRequest
from portal.sandboxes.gpu_choice import models_accepted
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from scheduler.cluster import (
    AUTO,
    CPU_ONLY,
    DEDICATED,
    MIG,
    MODES,
    MPS,
    TIMESLICE,
    DepartmentShare,
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    MigSlot,
    ModelLimit,
    ProjectShare,
    Request,
    Running,
    Snapshot,
)
from scheduler.fairshare import decayed_usage
from scheduler.topology import NO_TOPOLOGY, Topology
from wire.spec import DRIVER_ISOLATION

S = SandboxState
HOLDING = (S.PLACING, S.STARTING, S.RUNNING, S.STOPPING)  # states whose devices are booked
PREEMPTIBLE_STATES = (S.PLACING, S.STARTING, S.RUNNING)


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
    mps_share: tuple[int, int] | None = None  # the size of its MPS shares (the oldest's)


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
        if kind == Allocation.Kind.MPS and held.mps_share is None:
            held.mps_share = (mps_mib, mps_threads)
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
        max_duration, preempt_after, preempt_at, grace,
    ) in rows.values_list(
        "pk", "project__slug", "host__name", "state", "tier__priority_class__value",
        "tier__priority_class__preemptible", "tier__cpu_limit", "tier__memory_limit_mib", "borrowed",
        "start", "max_duration", "tier__preempt_after", "preempt_at", "tier__preempt_grace",
    ):  # fmt: skip
        held = tuple(grants.get(pk, ()))
        if host is None and not held:
            continue  # holds nothing anywhere
        ends_at = start + max_duration
        promised = preempt_at is not None or state not in PREEMPTIBLE_STATES
        running.append(
            Running(
                sandbox_id=pk,
                project=project,
                host=host or "",
                grants=held,
                priority=priority,
                started_at=start.timestamp(),
                # A warned victim frees its devices at its stop, not at its time limit: what
                # backfill and reservations plan with.
                ends_at=(min(ends_at, preempt_at) if preempt_at else ends_at).timestamp(),
                preemptible=preemptible and promised is False,
                # Promised away (warned, or stopping) it is no one's victim again, not even a
                # reclaim's; otherwise not before its tier's minimum runtime.
                preemptible_at=math.inf if promised else (start + preempt_after).timestamp(),
                warning_s=grace.total_seconds(),
                borrowed=borrowed,
                cpu_milli=_cpu_milli(cpu_cores),
                memory_mib=memory_mib,
            )
        )
    return running


# Drivers whose hosts form one cluster that runs a job across several of them.
MULTI_NODE_DRIVERS = {"slurm": "slurm"}


def build_snapshot() -> Snapshot:
    """Every host and GPU, what is free on them and who holds the rest."""
    gpu_rows = list(
        Gpu.objects.order_by("host_id", "index").values_list(
            "pk", "host_id", "index", "uuid", "model", "memory_mib", "sharing_mode", "timeslice_replicas",
            "state", "engine_modes", "numa_node", "links",
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
    no_gpus = {
        pk for pk, *_, driver, backend in hosts if driver == "libvirt" and backend not in SIMULATED_BACKENDS
    }
    gpus: dict[int, list[GpuState]] = defaultdict(list)
    # What each GPU says of where it sits, by host: only hosts whose agents report any.
    placed: dict[int, list[tuple[int, int | None, dict[int, str]]]] = defaultdict(list)
    one_size = settings.MPS_ONE_SIZE_PER_GPU
    for (
        pk, host_id, index, uuid, model, memory_mib, sharing_mode, replicas, state, engine_modes, numa, links,
    ) in gpu_rows:  # fmt: skip
        if numa is not None or links:
            placed[host_id].append((index, numa, {int(peer): level for peer, level in links.items()}))
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
                mps_share=used.mps_share,
                mps_one_size=one_size,
                offers=tuple(engine_modes) or MODES,
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
            # A Slurm gateway's nodes run a job across several of them (one gateway a fleet).
            cluster=MULTI_NODE_DRIVERS.get(driver, ""),
            topology=Topology.from_gpus(placed[pk]) if pk in placed else NO_TOPOLOGY,
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
    preempt_after_s: float = 0.0  # once placed, its tier's minimum runtime before preemption
    warning_s: float = 0.0  # once placed, its tier's preemption warning


def _request(
    request_id: int,
    *,
    project: str,
    priority: int,
    submitted_at: float,
    mode: str,
    gpu_count: int,
    nodes: int = 1,
    mig_profile: str,
    mps_memory_mib: int,
    mps_thread_pct: int,
    max_duration: timedelta,
    cpu_cores: float,
    memory_mib: int,
    isolation: str,
    gpu_models: tuple[str, ...] = (),
) -> Request:
    """What the scheduler sees of a request: only the fields of its tier's sharing mode."""
    return Request(
        id=request_id,
        project=project,
        priority=priority,
        submitted_at=submitted_at,
        mode=mode,
        gpu_count=gpu_count if mode == DEDICATED else 1,
        nodes=nodes if mode == DEDICATED else 1,
        mig_profile=mig_profile if mode == MIG else "",
        mps_memory_mib=mps_memory_mib if mode == MPS else 0,
        mps_thread_pct=mps_thread_pct if mode == MPS else 0,
        max_duration_s=max_duration.total_seconds(),
        cpu_milli=_cpu_milli(cpu_cores),
        memory_mib=memory_mib,
        isolation=isolation,
        gpu_models=gpu_models if mode != CPU_ONLY else (),
    )


def read_queue() -> list[Queued]:
    """Queued requests, less those waiting for the victims they preempted to stop (warned
    victims included: they run until their grace period ends)."""
    # A victim holds its devices through its warning (running) and its stop (stopping).
    waiting = Sandbox.objects.filter(state__in=(S.RUNNING, S.STOPPING), preempted_for__isnull=False).values(
        "preempted_for"
    )
    rows = Sandbox.objects.filter(state=S.QUEUED).exclude(pk__in=waiting).order_by("requested_at", "pk")
    queued = []
    for (
        pk, project, priority, preemptible, requested_at, mode, gpu_count, mig_profile, mps_mib, mps_threads,
        asked_for, tier_max, cpu_cores, memory_mib, isolation, reason, preempt_after, grace, nodes,
        gpu_model, tier_models,
    ) in rows.values_list(
        "pk", "project__slug", "tier__priority_class__value", "tier__priority_class__preemptible",
        "requested_at", "tier__sharing_mode", "gpu_count", "mig_profile", "mps_memory_mib", "mps_thread_pct",
        "max_duration", "tier__max_duration", "tier__cpu_limit", "tier__memory_limit_mib", "isolation",
        "pending_reason", "tier__preempt_after", "tier__preempt_grace", "nodes",
        "gpu_model", "tier__gpu_models",
    ):  # fmt: skip
        request = _request(
            pk, project=project, priority=priority, submitted_at=requested_at.timestamp(), mode=mode,
            gpu_count=gpu_count, nodes=nodes, mig_profile=mig_profile, mps_memory_mib=mps_mib,
            mps_thread_pct=mps_threads,
            max_duration=asked_for or tier_max, cpu_cores=cpu_cores, memory_mib=memory_mib,
            isolation=isolation, gpu_models=models_accepted(gpu_model, tier_models),
        )  # fmt: skip
        queued.append(
            Queued(request, reason, preemptible, preempt_after.total_seconds(), grace.total_seconds())
        )
    return queued


def build_queue() -> list[Request]:
    """The requests the next cycle decides for."""
    return [q.request for q in read_queue()]


def scheduler_request(request_id: int, asked: SandboxRequest, submitted_at: float) -> Request:
    """What the scheduler would see of a request being written (the form's preview)."""
    tier = asked.tier
    return _request(
        request_id, project=asked.project.slug, priority=tier.priority_class.value, submitted_at=submitted_at,
        mode=tier.sharing_mode, gpu_count=asked.gpu_count, nodes=asked.nodes, mig_profile=asked.mig_profile,
        mps_memory_mib=asked.mps_memory_mib, mps_thread_pct=asked.mps_thread_pct,
        max_duration=asked.duration or tier.max_duration, cpu_cores=tier.cpu_limit,
        memory_mib=tier.memory_limit_mib, isolation=asked.isolation,
        gpu_models=models_accepted(asked.gpu_model, tier.gpu_models),
    )  # fmt: skip


def model_limits(
    now: datetime,
) -> tuple[dict[str, tuple[ModelLimit, ...]], dict[str, tuple[ModelLimit, ...]]]:
    """The limits per GPU model (``ModelQuota``) of each project, by slug, and of each
    department, by name; a limit whose GPU-hours of the month are used up is closed, saying
    so. One query, and two a limit on hours."""
    projects: dict[str, list[ModelLimit]] = defaultdict(list)
    departments: dict[str, list[ModelLimit]] = defaultdict(list)
    for row in ModelQuota.objects.select_related("quota__project", "department").order_by("pk"):
        used_up = model_hours_used_up(row, now)
        limit = row.max_gpus * 1000 if row.max_gpus is not None else None
        found = ModelLimit(row.name, frozenset(row.covered), limit, f"quota: {used_up}" if used_up else "")
        if row.quota is not None:
            projects[row.quota.project.slug].append(found)
        elif row.department is not None:
            departments[row.department.name].append(found)
    return (
        {slug: tuple(limits) for slug, limits in projects.items()},
        {name: tuple(limits) for name, limits in departments.items()},
    )


def build_fairshare(now: float) -> FairShareState:
    """Weights and quotas from QuotaPolicy and the departments above projects; usage decayed
    from the ledger's intervals."""
    half_life_s = settings.FAIRSHARE_HALF_LIFE_H * 3600.0
    since = timezone.now() - timedelta(seconds=half_life_s * 6)  # older usage weighs < 2%
    intervals: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for slug, start, end, milli in UsageRecord.objects.filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=since)
    ).values_list("project__slug", "started_at", "ended_at", "milli_gpu"):
        intervals[slug].append((start.timestamp(), end.timestamp() if end else now, milli))
    projects = {}
    per_model, per_department_model = model_limits(timezone.now())
    for slug, weight, guaranteed, max_gpus, department in QuotaPolicy.objects.values_list(
        "project__slug", "weight", "guaranteed_gpus", "max_gpus", "department__name"
    ):
        projects[slug] = ProjectShare(
            weight=weight,
            guaranteed_milli=int(guaranteed * 1000) or None,
            limit_milli=max_gpus * 1000,
            usage_gpu_s=decayed_usage(intervals.pop(slug, []), now, half_life_s),
            model_limits=per_model.get(slug, ()),
            department=department,
        )
    for slug, spans in intervals.items():  # projects without a policy: default weight, no limits
        projects[slug] = ProjectShare(usage_gpu_s=decayed_usage(spans, now, half_life_s))
    departments = {
        d.name: DepartmentShare(
            parent=d.parent.name if d.parent is not None else None,
            weight=d.weight,
            guaranteed_milli=int(d.guaranteed_gpus * 1000) if d.guaranteed_gpus is not None else None,
            limit_milli=d.max_gpus * 1000 if d.max_gpus is not None else None,
            model_limits=per_department_model.get(d.name, ()),
        )
        for d in Department.objects.select_related("parent")
    }
    return FairShareState(projects=projects, departments=departments, half_life_s=half_life_s)
