"""The resume contract: what a sandbox is told of its earlier runs, and where it keeps state.

A sandbox queued again (preempted on a tier that requeues, its host lost on a tier that
requeues on failure, or moved by a fleet plan) starts again from its command: the program
must pick up its own work. So each launch is an ``Attempt``, and the launch message tells
the sandbox, in its environment (documented in docs/resume.md):

* ``GPUSHARE_ATTEMPT``: 1 for the first run, 2 for the next...;
* ``GPUSHARE_RESUMED``: ``1`` from the second attempt on, else ``0``;
* ``GPUSHARE_LAST_END`` and ``GPUSHARE_LAST_END_MESSAGE``: why the last attempt ended
  (``preempted``, ``lost``, ``moved``) and the portal's words for it;
* ``GPUSHARE_CHECKPOINT_DIR``: a folder of its own in its project's storage (else its
  home's), the same on every attempt and every host, that the agent makes before it starts.

Every function here is called with the sandbox's row locked (portal/sandboxes/actions.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone

from portal.catalog.models import Storage, Tier
from portal.sandboxes.models import Attempt, Sandbox
from wire.spec import CHECKPOINT_DIR_VARIABLE

CHECKPOINTS = ".gpushare/checkpoints"  # in the storage's folder: one sub-folder per sandbox


def begin_attempt(sandbox: Sandbox, host_name: str, verb: str) -> tuple[str, ...]:
    """Count a new launch of a sandbox just given its allocation key; a move relaunches one
    whose attempt is still open, which ends it as moved. Returns the fields to save."""
    Attempt.objects.filter(sandbox=sandbox, ended_at__isnull=True).update(
        ended_at=timezone.now(), end=Attempt.End.MOVED, end_message=verb[:300]
    )
    sandbox.attempt += 1
    Attempt.objects.create(
        sandbox=sandbox, number=sandbox.attempt, allocation_key=sandbox.allocation_key, host_name=host_name
    )
    return ("attempt",)


def end_attempt(sandbox: Sandbox, at: datetime, end: str, message: str) -> None:
    """Say why the sandbox's current attempt ended (once: a later word does not replace it)."""
    if sandbox.attempt:
        Attempt.objects.filter(sandbox=sandbox, number=sandbox.attempt, ended_at__isnull=True).update(
            ended_at=at, end=end, end_message=message[:300]
        )


def checkpoint_dir(tier: Tier, sandbox: Sandbox) -> str:
    """Where the sandbox keeps its checkpoints, as it sees the path: in the tier's project
    storage, else in its home storage; "" when the tier mounts neither."""
    writable = [
        s for s in tier.storages.all() if s.active and s.kind in (Storage.Kind.PROJECT, Storage.Kind.HOME)
    ]
    if not writable:
        return ""
    chosen = min(writable, key=lambda s: (s.kind != Storage.Kind.PROJECT, s.name))
    return f"{chosen.mount_path.rstrip('/')}/{CHECKPOINTS}/sandbox-{sandbox.pk}"


def resume_env(sandbox: Sandbox, folder: str) -> dict[str, str]:
    """The contract's variables for the sandbox's current attempt."""
    env = {
        "GPUSHARE_ATTEMPT": str(max(1, sandbox.attempt)),
        "GPUSHARE_RESUMED": "1" if sandbox.attempt > 1 else "0",
    }
    if folder:
        env[CHECKPOINT_DIR_VARIABLE] = folder
    if sandbox.attempt > 1:
        last = Attempt.objects.filter(sandbox=sandbox, number=sandbox.attempt - 1).first()
        if last is not None and last.end:
            env["GPUSHARE_LAST_END"] = last.end
            env["GPUSHARE_LAST_END_MESSAGE"] = last.end_message
    return env


def attempts_of(sandbox: Sandbox) -> list[dict[str, Any]]:
    """Each attempt as the API and ``gpushare logs`` show it, oldest first."""
    return [
        {
            "number": a.number,
            "host": a.host_name,
            "placed_at": a.placed_at,
            "ended_at": a.ended_at,
            "end": a.end,
            "end_message": a.end_message,
            "current": a.number == sandbox.attempt,
        }
        for a in sandbox.attempts.all()
    ]
