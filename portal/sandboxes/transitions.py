"""The sandbox state machine's core: which moves are allowed, the one function that makes a
move (its event, notification, webhook and audit line), and the steps every end shares
(bill up to the end, give the devices back, queue again). ``actions`` and ``preemption``
build the state changes callers ask for on these; nothing else moves a sandbox's state.
Every function here expects the caller's transaction and the sandbox's row lock.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from portal.audit import trail
from portal.billing import ledger
from portal.sandboxes import live, notify, nudge, resume, webhooks
from portal.sandboxes.models import (
    ENDED_STATES,
    Allocation,
    Attempt,
    Sandbox,
    SandboxEvent,
    SandboxState,
    StopCause,
)
from wire.messages import to_host

log = logging.getLogger(__name__)
S = SandboxState

# Allowed transitions; anything else is refused (and logged) rather than written.
TRANSITIONS: dict[str, set[str]] = {
    S.REQUESTED: {S.QUEUED, S.FAILED, S.STOPPED},
    S.QUEUED: {S.PLACING, S.STOPPED, S.FAILED, S.EXPIRED},
    S.PLACING: {S.STARTING, S.QUEUED, S.STOPPING, S.FAILED},
    S.STARTING: {S.RUNNING, S.STOPPING, S.FAILED, S.QUEUED},
    S.RUNNING: {S.STOPPING, S.FAILED, S.PREEMPTED, S.EXPIRED, S.QUEUED},
    # placing/queued: a sandbox stopped by a defragmentation plan, relaunched elsewhere
    S.STOPPING: {S.STOPPED, S.FAILED, S.PREEMPTED, S.EXPIRED, S.PLACING, S.QUEUED},
}
PHASE_TIMESTAMPS: dict[str, str] = {S.PLACING: "placed_at", S.STOPPING: "stop_requested_at"}


def transition(
    sandbox: Sandbox,
    to: str,
    *,
    actor: Any = None,
    message: str = "",
    data: dict[str, Any] | None = None,
    also: tuple[str, ...] = (),
) -> None:
    """Move a locked sandbox to ``to`` and write its event. Caller holds the row lock.
    ``also``: fields the caller set on it, saved in the same UPDATE."""
    if to not in TRANSITIONS.get(sandbox.state, set()):
        raise ValueError(f"sandbox {sandbox.pk}: {sandbox.state} -> {to} is not a transition")
    now = timezone.now()
    event = SandboxEvent.objects.create(
        sandbox=sandbox,
        at=now,
        from_state=sandbox.state,
        to_state=to,
        actor=actor if getattr(actor, "is_authenticated", False) else None,
        message=message[:300],
        data=data or {},
    )
    notify.on_transition(sandbox, to, message, actor)
    if to in ENDED_STATES:
        webhooks.emit_stopped(sandbox, event)
    previous = sandbox.state
    if getattr(actor, "is_authenticated", False) and actor.pk != sandbox.owner_id:
        trail.record(actor, f"sandbox.{to}", sandbox, {"state": sandbox.state}, {"state": to}, message)
    sandbox.state = to
    fields = ["state", *also]
    if to in PHASE_TIMESTAMPS:
        setattr(sandbox, PHASE_TIMESTAMPS[to], now)
        fields.append(PHASE_TIMESTAMPS[to])
    if to != S.QUEUED and sandbox.pending_reason:
        sandbox.pending_reason = ""
        fields.append("pending_reason")
    if (to == S.QUEUED or to in ENDED_STATES) and sandbox.moving_plan_id is not None:
        sandbox.moving_plan_id = None  # lost or ended mid-move: the plan no longer owns it
        fields.append("moving_plan")
    sandbox.save(update_fields=fields)
    live.sandbox_changed(sandbox.pk, to)
    # The operator's one line per transition (``make run`` shows it), once it is true.
    line = f"sandbox {sandbox.pk}: {previous} → {to}" + (f": {message}" if message else "")
    transaction.on_commit(lambda: log.info("%s", line))


# What one sandbox's action reads of its relations: its host (messages, stops) and its tier
# (requeue, billing). A launch reads all five; joined into every action, the five made
# PostgreSQL's planner search join orders for ~0.9 ms a call (two joins: ~0.15 ms), for rows
# most actions never read.
ACTION_RELATED = ("host", "tier")
LAUNCH_RELATED = ("host", "tier", "project", "owner", "image")


def locked(sandbox_id: int, related: tuple[str, ...] = ACTION_RELATED) -> Sandbox | None:
    return locking(related).filter(pk=sandbox_id).first()


def locked_by_key(allocation_key: str) -> Sandbox | None:
    """The sandbox an agent's report names by its allocation key, locked."""
    return locking(ACTION_RELATED).filter(allocation_key=allocation_key).first()


def locking(related: tuple[str, ...] = LAUNCH_RELATED) -> Any:
    """Sandboxes whose rows a query locks (their rows alone: ``of``), with what the actions
    read of them: read lazily, a launch's host, tier, project, owner and image were five more
    queries, a fifth of a second for a cycle that places 155 at the cluster's size."""
    return Sandbox.objects.select_related(*related).select_for_update(of=("self",))


def release(sandbox: Sandbox, at: datetime) -> None:
    """Bill the run up to ``at`` and give its devices back (row lock held)."""
    ledger.close_interval(sandbox, at)
    Allocation.objects.filter(sandbox=sandbox, active=True).update(active=False, released_at=at)


def requeue(
    sandbox: Sandbox, message: str, why: str, data: dict[str, Any] | None = None, at: datetime | None = None
) -> str:
    """Put a released sandbox back in the queue, keeping its age; its attempt ended ``why``
    (an ``Attempt.End``) at ``at`` (now). Its old allocation key matches nothing any more, so
    a copy that turns up later is stopped as an orphan."""
    resume.end_attempt(sandbox, at or timezone.now(), why, message)
    old_key = sandbox.allocation_key
    sandbox.host, sandbox.allocation_key, sandbox.handle = None, "", None
    sandbox.started_at = sandbox.placed_at = None
    transition(
        sandbox,
        S.QUEUED,
        message=message,
        data={**(data or {}), "lost_allocation": old_key},
        also=("host", "allocation_key", "handle", "started_at", "placed_at"),
    )
    # Forgotten after the move, which told the owner why (a preemption or a fault): queued
    # again it is no one's victim, and a beneficiary must not wait for it.
    if sandbox.preempted_for_id is not None or sandbox.preempt_at is not None or sandbox.stop_cause:
        sandbox.preempted_for_id, sandbox.preempt_at, sandbox.stop_cause = None, None, ""
        sandbox.save(update_fields=["preempted_for", "preempt_at", "stop_cause"])
    nudge.ask_for_cycle()
    return S.QUEUED


def end_stopping(sandbox: Sandbox, ended_at: datetime, message: str, why: str = "") -> str:
    """End a stopping sandbox: preempted when it was stopped for another (queued again when
    its tier says so), expired when it was stopped at its time limit, else stopped."""
    if sandbox.stop_cause == StopCause.PREEMPTED:
        note = f"preempted for sandbox {sandbox.preempted_for_id}" + (f"; {why}" if why else "")
        if sandbox.tier.requeue_on_preemption:
            release(sandbox, ended_at)
            return requeue(
                sandbox, f"{note}; queued again, as its tier says", Attempt.End.PREEMPTED, at=ended_at
            )
        end(sandbox, S.PREEMPTED, ended_at, note)
        return S.PREEMPTED
    if sandbox.stop_cause == StopCause.EXPIRED:
        end(sandbox, S.EXPIRED, ended_at, "expired: it reached its time limit")
        return S.EXPIRED
    end(sandbox, S.STOPPED, ended_at, message)
    return S.STOPPED


def end(sandbox: Sandbox, to: str, ended_at: datetime, message: str, also: tuple[str, ...] = ()) -> None:
    """Close usage, release the devices and move to an end state (row lock held). ``also``:
    fields the caller set on the sandbox, saved with the move."""
    release(sandbox, ended_at)
    resume.end_attempt(sandbox, ended_at, Attempt.End.ENDED, message)
    sandbox.ended_at = ended_at
    transition(sandbox, to, message=message, also=("ended_at", *also))
    nudge.ask_for_cycle()


def send_stop_after_commit(sandbox: Sandbox) -> None:
    host_name = sandbox.host.name if sandbox.host else ""
    key, handle, sandbox_id = sandbox.allocation_key, sandbox.handle, sandbox.pk
    transaction.on_commit(lambda: to_host(host_name).stop_sandbox(key, sandbox_id, handle))
