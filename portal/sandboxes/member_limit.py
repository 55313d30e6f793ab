"""A member's own GPU limit inside a project (``Membership.max_gpus``, set by its managers):
a student may hold at most 2 GPUs of the group's 8.

It counts, in whole-GPU equivalents as the project's quota does, what the member's live
sandboxes in the project hold (their active allocations) and what those still waiting ask
for, plus the new request. Counting the waiting ones too keeps the limit true at every
moment without the scheduler knowing of it: a request past it is refused when made, by
name, as Kubernetes' ResourceQuota refuses a pod at admission. ``do_request_sandbox``
checks it under its lock on the project row, so two requests at once cannot both pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.models import Q, Sum

from portal.accounts.models import Membership
from portal.sandboxes.models import LIVE_STATES, Sandbox
from scheduler.cluster import DEDICATED, Request
from scheduler.fairshare import demand_milli

if TYPE_CHECKING:
    from portal.sandboxes.actions import SandboxRequest


def asked_milli(mode: str, gpu_count: int, nodes: int, mig_profile: str, mps_thread_pct: int) -> int:
    """What a request counts before it is placed: the scheduler's estimate (a time-slice
    replica as a whole GPU, its share unknown until placed), times its nodes."""
    request = Request(
        0, "", 0, 0.0, mode, gpu_count=gpu_count, mig_profile=mig_profile, mps_thread_pct=mps_thread_pct
    )
    return demand_milli(request) * (nodes if mode == DEDICATED else 1)


def member_limit_refusal(user: Any, req: SandboxRequest) -> str | None:
    """Why ``req`` would take ``user`` past their own limit in its project, or None."""
    limit = (
        Membership.objects.filter(user_id=user.pk, project=req.project)
        .values_list("max_gpus", flat=True)
        .first()
    )
    if limit is None:
        return None
    tier = req.tier
    wanted = asked_milli(tier.sharing_mode, req.gpu_count, req.nodes, req.mig_profile, req.mps_thread_pct)
    if wanted == 0:
        return None  # a CPU-only sandbox holds no GPU
    live = (
        Sandbox.objects.filter(project=req.project, owner_id=user.pk, state__in=LIVE_STATES)
        .annotate(held=Sum("allocations__milli_gpu", filter=Q(allocations__active=True)))
        .values_list("tier__sharing_mode", "gpu_count", "nodes", "mig_profile", "mps_thread_pct", "held")
    )
    taken = sum(
        int(held) if held is not None else asked_milli(mode, gpus, nodes, profile, threads)
        for mode, gpus, nodes, profile, threads, held in live
    )
    if taken + wanted <= limit * 1000:
        return None
    gpus = f"{limit} GPU{'s' if limit != 1 else ''}"
    return (
        f"You may hold at most {gpus} in {req.project.name} (set by its managers): your sandboxes "
        f"there hold or wait for {taken / 1000:g} and this needs {wanted / 1000:g} more."
    )
