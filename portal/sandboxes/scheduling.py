"""The control worker's scheduling cycle: snapshot the database, ask the pure scheduler,
commit its decisions. One cycle at a time, under a Redis lock."""

from __future__ import annotations

import logging
from collections import defaultdict

from django.db import transaction
from django.db.models import Prefetch

from portal.fleet.models import Gpu, Host
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from scheduler.cluster import GpuState, HostState, MigSlot, Pending, Place, Request, Snapshot
from scheduler.cycle import run_cycle
from scheduler.policies import get_policy

log = logging.getLogger(__name__)


def build_snapshot() -> Snapshot:
    live = Allocation.objects.filter(active=True)
    held: dict[int, list[Allocation]] = defaultdict(list)
    for alloc in live.only(
        "gpu_id", "kind", "mig_instance_id", "mps_memory_mib", "mps_thread_pct", "replica"
    ):
        held[alloc.gpu_id].append(alloc)
    busy_mig = {a.mig_instance_id for allocs in held.values() for a in allocs if a.mig_instance_id}
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
                    available=gpu.state == Gpu.State.AVAILABLE,
                    exclusive_busy=any(a.kind == Allocation.Kind.EXCLUSIVE for a in allocs),
                    mig=[
                        MigSlot(m.uuid, m.profile, m.start, m.memory_slices, busy=m.pk in busy_mig)
                        for m in gpu.mig_instances.all()
                    ],
                    mps_used_mib=sum(a.mps_memory_mib for a in allocs),
                    mps_used_threads=sum(a.mps_thread_pct for a in allocs),
                    replicas=gpu.timeslice_replicas if gpu.sharing_mode == "timeslice" else 0,
                    replicas_used={a.replica for a in allocs if a.replica is not None},
                )
            )
        hosts.append(HostState(name=host.name, up=host.state == Host.State.UP, gpus=gpus))
    return Snapshot(hosts=hosts)


def build_queue() -> list[Request]:
    queued = Sandbox.objects.filter(state=SandboxState.QUEUED).select_related(
        "tier__priority_class", "project"
    )
    return [
        Request(
            id=s.pk,
            project=s.project.slug,
            priority=s.tier.priority_class.value,
            submitted_at=s.requested_at.timestamp(),
            mode=s.tier.sharing_mode,
            gpu_count=s.gpu_count,
            mig_profile=s.mig_profile,
            mps_memory_mib=s.mps_memory_mib,
            mps_thread_pct=s.mps_thread_pct,
        )
        for s in queued
    ]


def schedule_once(now: float, policy_name: str = "first-fit") -> tuple[int, int]:
    """One cycle in one transaction; returns (placed, pending). The caller holds the lock.

    Each placement runs in its own savepoint (inside ``do_place``): one refused by a
    database constraint rolls back alone and its sandbox stays queued for the next cycle.
    Launch messages go out only after the whole cycle has committed.
    """
    placed = pending = 0
    with transaction.atomic():
        queue = build_queue()
        if not queue:
            return 0, 0
        decisions = run_cycle(build_snapshot(), queue, get_policy(policy_name), now)
        for decision in decisions:
            if isinstance(decision, Place):
                if actions.do_place(decision.request_id, decision.host, decision.grants):
                    placed += 1
            elif isinstance(decision, Pending):
                actions.do_set_pending_reason(decision.request_id, decision.reason)
                pending += 1
    if placed:
        log.info("scheduling cycle placed %d, %d pending", placed, pending)
    return placed, pending
