"""In-app notifications: what a user should hear about without watching a page.

Written inside the transaction of the change they report (so a rolled-back change never
notifies), by ``actions`` on transitions and by the few places that know more: the
scheduling cycle (a request starts waiting), culling (idle warnings), drains. Each is also
handed, after that commit, to the mail task, which mails those of the kinds their user
chose (``portal.notifications.emails``, which sits above this app: the handing over is here,
so the actions that write a notification never import the mail).
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from portal.quotas.models import QuotaPolicy
from portal.quotas.usage import gpu_hours_since, month_start
from portal.sandboxes import unread
from portal.sandboxes.models import Allocation, Notification, Sandbox, SandboxState, StopCause
from wire import dispatch

NEAR_QUOTA = 0.8  # a project using this share of a quota limit hears about it
MAX_PER_MESSAGE = 100  # notifications per task message: a burst of 1,000 waits is 10 messages


def notify_owner(sandbox: Sandbox, kind: str, message: str) -> None:
    """By the owner's id: an action's locked sandbox does not load its owner's row."""
    note = Notification.objects.create(
        user_id=sandbox.owner_id, sandbox=sandbox, kind=kind, message=message[:300]
    )
    unread.forget([sandbox.owner_id])
    queue_after_commit([note.pk])


def on_transition(sandbox: Sandbox, to: str, message: str, actor: Any) -> None:
    """The owner hears of a start, a requeue, a stop someone else asked for, and of every
    end they did not cause themselves (culling tells its own story when it stops one)."""
    S = SandboxState
    label = f"Sandbox {sandbox.pk}" + (f" ({sandbox.name})" if sandbox.name else "")
    actor_id = getattr(actor, "pk", None)
    if actor_id is not None and actor_id == sandbox.owner_id:
        return
    if to == S.RUNNING:
        where = f" on {sandbox.host.name}" if sandbox.host else ""
        notify_owner(sandbox, Notification.Kind.STARTED, f"{label} is running{where}.")
    elif to == S.QUEUED and sandbox.state != S.REQUESTED:  # back in the queue: requeued
        preempted = sandbox.stop_cause == StopCause.PREEMPTED
        notify_owner(
            sandbox,
            Notification.Kind.PREEMPTED if preempted else Notification.Kind.QUEUED,
            f"{label}: {message}",
        )
    elif to == S.STOPPING and actor_id is not None:
        who = actor.get_username() if hasattr(actor, "get_username") else "an admin"
        notify_owner(sandbox, Notification.Kind.ENDED, f"{label} is being stopped by {who}: {message}")
    elif to in (S.PREEMPTED, S.FAILED, S.EXPIRED):
        kinds: dict[str, str] = {S.PREEMPTED: Notification.Kind.PREEMPTED, S.FAILED: Notification.Kind.FAILED}
        kind = kinds.get(to, Notification.Kind.ENDED)
        notify_owner(sandbox, kind, f"{label}: {message}")
    elif to == S.STOPPED and sandbox.state == S.STOPPING:
        if sandbox.stop_cause in (StopCause.ASKED, StopCause.CULLED, StopCause.OVER_SHARE):
            # asked by a person (told then, or it was the owner), or by culling or the GPU
            # memory rule (each told then, with its figures)
            return
        notify_owner(sandbox, Notification.Kind.ENDED, f"{label}: {message}")


def on_first_waits(waits: list[tuple[int, int, str]]) -> None:
    """Owners hear why their sandbox waits, the first time it does: (sandbox id, owner id,
    reason) each, written at once (a burst of requests all start waiting in one cycle)."""
    notes = Notification.objects.bulk_create(
        Notification(
            user_id=owner,
            sandbox_id=pk,
            kind=Notification.Kind.QUEUED,
            message=f"Sandbox {pk} waits: {reason}"[:300],
        )
        for pk, owner, reason in waits
    )
    unread.forget(owner for _pk, owner, _reason in waits)
    queue_after_commit([note.pk for note in notes])  # ids returned by PostgreSQL and SQLite alike


def on_request(sandbox: Sandbox, quota: QuotaPolicy | None, live: int) -> None:
    """Tell the requester when their project is near a quota limit: ``quota`` and its ``live``
    sandboxes (this one among them) as the request's quota check read them, under the
    project's lock (read again here, they were two of a POST's twenty queries)."""
    if quota is None:
        return
    held = (
        Allocation.objects.filter(sandbox__project_id=sandbox.project_id, active=True).aggregate(
            milli=Sum("milli_gpu")
        )["milli"]
        or 0
    )
    notes = []
    if quota.max_live_sandboxes and live >= NEAR_QUOTA * quota.max_live_sandboxes:
        notes.append(f"{live} of its {quota.max_live_sandboxes} live sandboxes")
    if quota.max_gpus and held >= NEAR_QUOTA * quota.max_gpus * 1000:
        notes.append(f"{held / 1000:g} of its {quota.max_gpus} GPUs")
    if quota.max_gpu_hours_month:
        now = timezone.now()
        used = gpu_hours_since(sandbox.project_id, month_start(now), now)
        if used >= NEAR_QUOTA * quota.max_gpu_hours_month:
            notes.append(f"{used:.1f} of its {quota.max_gpu_hours_month} GPU-hours this month")
    if notes:
        message = f"Project {sandbox.project.name} uses {' and '.join(notes)}."
        notify_owner(sandbox, Notification.Kind.QUOTA, message)


def queue_after_commit(notification_ids: list[int]) -> None:
    """Hand these notifications to the mail task once the current transaction commits
    (at once outside one; never if it rolls back). ``robust``: a broker that cannot be
    reached costs the mails, logged, never the change that was committed."""
    ids = [pk for pk in notification_ids if pk is not None]
    for start in range(0, len(ids), MAX_PER_MESSAGE):
        chunk = ids[start : start + MAX_PER_MESSAGE]
        transaction.on_commit(
            functools.partial(dispatch.to_control, "email_notifications", chunk), robust=True
        )
