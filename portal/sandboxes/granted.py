"""The devices an engine granted, where it chose them itself (issue 39): Slurm binds a job's
GRES to GPUs of its own choosing on the node gpushare picked, so the placement's GPUs and the
job's may differ (counts and the node always agree). The launch report carries the GPUs the
job holds (``SandboxHandle.devices``); the sandbox's allocations follow them here, so that the
fleet, the GPU pages and the next placement see which GPU is really busy.

A GPU the job got may be booked, in gpushare's books, by another sandbox of the same node
whose job in truth holds the GPU this one was placed on (the two placements crossed): the
two whole-GPU allocations swap. The rows are moved while inactive, so that the partial
unique indexes (one live allocation a whole GPU, a replica) hold at every statement.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from portal.fleet.models import Gpu
from portal.sandboxes.models import Allocation, Sandbox

log = logging.getLogger(__name__)


def follow_granted_devices(sandbox: Sandbox, granted: Sequence[str]) -> str:
    """Re-point ``sandbox``'s active allocations at the GPUs (uuids) its engine granted;
    what was moved, for its event log ("" when nothing was). Inside the caller's transaction."""
    allocations = list(sandbox.allocations.filter(active=True).select_related("gpu"))
    placed = {a.gpu.uuid for a in allocations}
    wanted = [u for u in dict.fromkeys(granted) if u not in placed]
    leaving = [a for a in allocations if a.gpu.uuid not in set(granted)]
    if not wanted or len(wanted) != len(leaving):
        if wanted:
            log.warning(
                "sandbox %s: granted %s, placed %s: not followed", sandbox.pk, granted, sorted(placed)
            )
        return ""
    targets = {g.uuid: g for g in Gpu.objects.select_for_update(no_key=True).filter(uuid__in=wanted)}
    hosts = {a.gpu.host_id for a in allocations}
    if len(targets) != len(wanted) or any(g.host_id not in hosts for g in targets.values()):
        log.warning("sandbox %s: granted GPUs %s are not on its hosts: not followed", sandbox.pk, wanted)
        return ""
    moves = list(zip(leaving, (targets[u] for u in wanted), strict=True))
    # Whole GPUs booked to other sandboxes on the GPUs granted to this one: they take the GPUs
    # this one leaves (their jobs hold those, or will say so in their own launch report).
    booked = Allocation.objects.filter(
        gpu__in=list(targets.values()), active=True, kind=Allocation.Kind.EXCLUSIVE
    )
    crossed = {a.gpu_id: a for a in booked.exclude(sandbox=sandbox).select_related("gpu")}
    moving = [a for a, _ in moves] + list(crossed.values())
    Allocation.objects.filter(pk__in=[a.pk for a in moving]).update(active=False)
    said = []
    for allocation, gpu in moves:
        other = crossed.get(gpu.pk)
        if other is not None:
            _point(other, allocation.gpu)
        said.append(f"GPU {allocation.gpu.index} -> {gpu.index}")
        _point(allocation, gpu)
    Allocation.objects.filter(pk__in=[a.pk for a in moving]).update(active=True)
    return "the engine granted other GPUs of the node than placed: " + ", ".join(said)


def _point(allocation: Allocation, gpu: Gpu) -> None:
    allocation.gpu, allocation.device_uuid = gpu, gpu.uuid  # a Slurm node has no MIG devices
    if allocation.kind == Allocation.Kind.TIMESLICE:  # a replica index free on the new GPU
        live = Allocation.objects.filter(gpu=gpu, active=True, kind=Allocation.Kind.TIMESLICE)
        taken = set(live.values_list("replica", flat=True))
        allocation.replica = next(i for i in range(len(taken) + 1) if i not in taken)
    allocation.save(update_fields=["gpu", "device_uuid", "replica"])
