"""One scheduling cycle: order the queue, place what fits, say why the rest waits."""

from __future__ import annotations

from scheduler.cluster import Decision, DeviceGrant, GpuState, Place, Request, Snapshot
from scheduler.policies import Policy


def order_queue(queue: list[Request]) -> list[Request]:
    """Higher priority first, then oldest first; the id breaks ties deterministically."""
    return sorted(queue, key=lambda r: (-r.priority, r.submitted_at, r.id))


def run_cycle(snapshot: Snapshot, queue: list[Request], policy: Policy, now: float) -> list[Decision]:
    """Decisions for every request in ``queue``; the snapshot given is not modified."""
    working = snapshot.copy()
    decisions: list[Decision] = []
    for request in order_queue(queue):
        decision = policy.place(working, request)
        if isinstance(decision, Place):
            _apply(working, decision)
        decisions.append(decision)
    return decisions


def _apply(snapshot: Snapshot, place: Place) -> None:
    """Book the grants in the working snapshot so later requests see them."""
    by_uuid = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    for grant in place.grants:
        _book(by_uuid[grant.gpu_uuid], grant)


def _book(gpu: GpuState, grant: DeviceGrant) -> None:
    if grant.kind == "exclusive":
        gpu.exclusive_busy = True
    elif grant.kind == "mig":
        for slot in gpu.mig:
            if slot.uuid == grant.mig_uuid:
                slot.busy = True
    elif grant.kind == "mps":
        gpu.mps_used_mib += grant.mps_memory_mib
        gpu.mps_used_threads += grant.mps_thread_pct
    elif grant.kind == "timeslice" and grant.replica is not None:
        gpu.replicas_used.add(grant.replica)
