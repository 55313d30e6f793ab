"""Idle culling: a running sandbox that holds a GPU without using it is warned, then stopped.

The rule is the tier's (``Tier.idle_rule`` says it in words, on the request form and the
sandbox page). Agents report each sandbox's mean GPU utilization over their window
(``UTIL_WINDOW_S``) with every heartbeat; a sandbox is idle from the first report under the
tier's threshold, counted from the start of that report's window, until a report at or
above it. After ``idle_minutes`` its owner is warned (a notification and an event); after
``idle_grace_minutes`` more, still idle, it is stopped with the reason recorded.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction

from portal.sandboxes import actions
from portal.sandboxes.live import sandbox_changed
from portal.sandboxes.models import Notification, Sandbox, SandboxEvent, SandboxState, StopCause
from portal.sandboxes.notify import notify_owner

log = logging.getLogger(__name__)


def do_cull_idle(now: datetime) -> list[int]:
    """One pass over running sandboxes of tiers that cull; returns the ids stopped."""
    stopped: list[int] = []
    candidates = (
        Sandbox.objects.filter(
            state=SandboxState.RUNNING, tier__idle_util_pct__gt=0, gpu_util_pct__isnull=False
        )
        .filter(preempt_at__isnull=True)
        .values_list("pk", flat=True)
    )  # a warned one stops anyway
    for sandbox_id in list(candidates):
        if _cull_one(sandbox_id, now):
            stopped.append(sandbox_id)
    return stopped


def _cull_one(sandbox_id: int, now: datetime) -> bool:
    with transaction.atomic():
        sandbox = (
            Sandbox.objects.select_for_update(of=("self",))
            .select_related("tier", "owner")
            .filter(pk=sandbox_id, state=SandboxState.RUNNING)
            .first()
        )
        if sandbox is None or sandbox.gpu_util_pct is None or sandbox.gpu_util_at is None:
            return False
        tier = sandbox.tier
        if sandbox.gpu_util_pct >= tier.idle_util_pct:
            if sandbox.idle_since or sandbox.idle_warned_at:
                sandbox.idle_since = sandbox.idle_warned_at = None
                sandbox.save(update_fields=["idle_since", "idle_warned_at"])
                sandbox_changed(sandbox.pk, sandbox.state)  # its page drops the warning
            return False
        if sandbox.idle_since is None:
            window = timedelta(seconds=sandbox.gpu_util_window_s or 0)
            sandbox.idle_since = max(sandbox.gpu_util_at - window, sandbox.started_at or sandbox.gpu_util_at)
            sandbox.save(update_fields=["idle_since"])
        idle_for = now - sandbox.idle_since
        warn_after = timedelta(minutes=tier.idle_minutes)
        stop_after = warn_after + timedelta(minutes=tier.idle_grace_minutes)
        if idle_for >= stop_after and sandbox.idle_warned_at is not None:
            reason = (
                f"culled: GPU utilization under {tier.idle_util_pct}% for "
                f"{int(idle_for.total_seconds() // 60)} min (tier {tier.name})"
            )
            log.info("sandbox %s %s", sandbox.pk, reason)
            notify_owner(sandbox, Notification.Kind.CULLED, f"Sandbox {sandbox.pk} was stopped: {reason}.")
            actions.do_request_stop(sandbox.pk, None, reason, cause=StopCause.CULLED)
            return True
        if idle_for >= warn_after and sandbox.idle_warned_at is None:
            deadline = now + (stop_after - idle_for)
            message = (
                f"idle: GPU utilization under {tier.idle_util_pct}% since {sandbox.idle_since:%H:%M} UTC; "
                f"it will be stopped at {deadline:%H:%M} UTC unless it uses its GPU"
            )
            sandbox.idle_warned_at = now
            sandbox.save(update_fields=["idle_warned_at"])
            sandbox_changed(sandbox.pk, sandbox.state)  # its page shows the warning without a poll
            SandboxEvent.objects.create(
                sandbox=sandbox, at=now, from_state=sandbox.state, to_state=sandbox.state, message=message
            )
            notify_owner(sandbox, Notification.Kind.IDLE, f"Sandbox {sandbox.pk} is {message}.")
    return False
