"""Preemption's state changes: a victim is warned, then stopped, or stopped at once.

A tier's ``preempt_grace`` is the time between the warning and the stop, as Slurm's
GraceTime and Kubernetes' termination grace period give it: the owner is told, the host's
agent sends the sandbox SIGTERM and runs the operator's checkpoint hook, and the victim
runs on until ``preempt_at``, when the control worker's tick stops it. All that while it
keeps its devices and is promised away (no other request may choose it), and the request
it makes room for waits out of the queue (``snapshot.read_queue``), so the scheduler
plans with the victim's devices free at ``preempt_at``. A tier without grace, or a victim
not yet running, is stopped at once.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from portal.sandboxes import live, notify
from portal.sandboxes.models import Notification, Sandbox, SandboxEvent, SandboxState, StopCause
from portal.sandboxes.transitions import locked, locked_by_key, send_stop_after_commit, transition
from wire.messages import to_host

log = logging.getLogger(__name__)
S = SandboxState


def do_preempt(victim_id: int, beneficiary_id: int, reason: str) -> bool:
    """Preempt ``victim_id`` for ``beneficiary_id``: warn it when its tier gives a grace
    period and it runs, else stop it now. False when it is no longer a victim to take.

    The victim keeps its devices until its agent confirms the stop (then it ends
    ``preempted``, or is queued again), so two sandboxes never share a GPU.
    """
    with transaction.atomic():
        victim = locked(victim_id)
        if victim is None or victim.state not in (S.PLACING, S.STARTING, S.RUNNING):
            return False
        if victim.preempt_at is not None:
            return False  # already warned, for another request
        victim.preempted_for_id, victim.stop_cause = beneficiary_id, StopCause.PREEMPTED
        grace = victim.tier.preempt_grace
        if victim.state == S.RUNNING and grace > timedelta(0):
            _warn(victim, beneficiary_id, reason, grace)
            return True
        transition(
            victim,
            S.STOPPING,
            message=f"preempted: {reason}",
            data={"preempted_for": beneficiary_id},
            also=("preempted_for", "stop_cause"),
        )
        send_stop_after_commit(victim)
    return True


def _warn(victim: Sandbox, beneficiary_id: int, reason: str, grace: timedelta) -> None:
    now = timezone.now()
    victim.preempt_at = now + grace
    victim.save(update_fields=["preempted_for", "stop_cause", "preempt_at"])
    at = timezone.localtime(victim.preempt_at).strftime("%H:%M:%S")
    SandboxEvent.objects.create(
        sandbox=victim, at=now, from_state=S.RUNNING, to_state=S.RUNNING,
        message=f"preemption warning: stops at {at} ({reason})",
        data={"preempted_for": beneficiary_id, "preempt_at": victim.preempt_at.isoformat()},
    )  # fmt: skip
    live.sandbox_changed(victim.pk, victim.state)  # its page shows the warning
    label = f"Sandbox {victim.pk}" + (f" ({victim.name})" if victim.name else "")
    # A reclaim is not about priority: the owner is told the capacity was borrowed.
    why = (
        "gives back capacity its project borrowed over its guarantee"
        if reason.startswith("reclaimed:")
        else "is preempted for higher-priority work"
    )
    notify.notify_owner(
        victim,
        Notification.Kind.PREEMPTED,
        f"{label} {why}: it stops at {at}, in {int(grace.total_seconds())} s. Save your work now.",
    )
    host, key, handle, pk = (
        victim.host.name if victim.host else "",
        victim.allocation_key,
        victim.handle,
        victim.pk,
    )
    stop_at = victim.preempt_at.timestamp()  # a time, not a delay: the message may wait in a queue
    transaction.on_commit(lambda: to_host(host).warn_sandbox(key, pk, handle, stop_at))


def do_stop_warned(now: datetime) -> list[int]:
    """Stop each warned victim whose grace period is over (the control worker's tick). A
    victim whose beneficiary no longer waits (withdrawn, or placed elsewhere meanwhile) is
    spared: the warning is called off and it runs on."""
    due = list(
        Sandbox.objects.filter(state=S.RUNNING, preempt_at__lte=now, stop_cause=StopCause.PREEMPTED)
        .order_by("preempt_at")
        .values_list("pk", flat=True)[:500]
    )
    stopped = []
    for pk in due:
        with transaction.atomic():
            victim = locked(pk)
            if victim is None or victim.state != S.RUNNING or victim.preempt_at is None:
                continue
            beneficiary = (
                None  # its request was deleted
                if victim.preempted_for_id is None
                else Sandbox.objects.filter(pk=victim.preempted_for_id)
                .values_list("state", flat=True)
                .first()
            )
            if beneficiary != S.QUEUED:
                _call_off(victim, beneficiary)
                continue
            transition(
                victim,
                S.STOPPING,
                message=f"preempted for sandbox {victim.preempted_for_id}: its grace period is over",
                data={"preempted_for": victim.preempted_for_id},
            )
            send_stop_after_commit(victim)
            stopped.append(pk)
    return stopped


def _call_off(victim: Sandbox, beneficiary_state: str | None) -> None:
    was_for = victim.preempted_for_id
    victim.preempted_for_id, victim.preempt_at, victim.stop_cause = None, None, ""
    victim.save(update_fields=["preempted_for", "preempt_at", "stop_cause"])
    why = f"sandbox {was_for} no longer waits ({beneficiary_state or 'gone'})"
    SandboxEvent.objects.create(
        sandbox=victim, at=timezone.now(), from_state=S.RUNNING, to_state=S.RUNNING,
        message=f"preemption called off: {why}",
    )  # fmt: skip
    live.sandbox_changed(victim.pk, victim.state)
    notify.notify_owner(
        victim,
        Notification.Kind.PREEMPTED,
        f"Sandbox {victim.pk}: the preemption is called off ({why}). It is no longer stopped, but its "
        "warning (SIGTERM) was sent: if that ended your work, start it again.",
    )


def do_record_warning(allocation_key: str, checkpoint: str) -> None:
    """The agent's account of a warning: what the checkpoint hook said, and the signal."""
    with transaction.atomic():
        sandbox = locked_by_key(allocation_key)
        if sandbox is None or sandbox.state not in (S.RUNNING, S.STOPPING):
            return
        SandboxEvent.objects.create(
            sandbox=sandbox, at=timezone.now(), from_state=sandbox.state, to_state=sandbox.state,
            message=f"preemption warning delivered: {checkpoint}"[:300],
        )  # fmt: skip
        live.sandbox_changed(sandbox.pk, sandbox.state)
