"""Pushes a sandbox's state changes to its open pages, over the socket each already holds for
its live chart (group ``sandbox.<id>``, whose members were checked at subscribe and are
re-checked while open: portal/telemetry/consumers.py). The page then fetches its status part
once; it no longer polls it every 2 s, which with 2,000 pages open was ~1,000 requests a
second of the same answer. Whatever adds a line to a sandbox's timeline without a transition
(an extension, a preemption warning, a plan's move, a terminal opened) or changes its launch's
progress calls ``sandbox_changed`` too: nothing else refreshes the part within 5 minutes.

Sent after the commit that made the change, so a page never fetches a state that was rolled
back. One transaction may move many sandboxes (a scheduling cycle places hundreds): their
changes wait in one batch, sent over one channel-layer connection by the first of the
transaction's on-commit callbacks. A change whose transaction rolled back stays in the batch
and goes out with the next commit: its page fetches its (unchanged) status once, harmless.
"""

from __future__ import annotations

import logging
import threading

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from wire.telemetry import SandboxChangedMessage, sandbox_group

log = logging.getLogger(__name__)
_local = threading.local()


def sandbox_changed(sandbox_id: int, state: str) -> None:
    """Called inside the transaction that moved the sandbox; the push waits for its commit."""
    pending: dict[int, str] = _local.__dict__.setdefault("pending", {})
    pending[sandbox_id] = state
    transaction.on_commit(_send_pending)


def _send_pending() -> None:
    pending: dict[int, str] = _local.__dict__.get("pending", {})
    if not pending:
        return  # an earlier callback of this commit sent them
    batch, _local.pending = pending, {}
    try:
        async_to_sync(_send)(batch)
    except Exception:  # a page that misses a push still has its slow poll
        log.warning("could not push %d sandbox state changes", len(batch), exc_info=True)


async def _send(batch: dict[int, str]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    for sandbox_id, state in batch.items():
        message = SandboxChangedMessage(type="sandbox.changed", sandbox=sandbox_id, state=state)
        await layer.group_send(sandbox_group(sandbox_id), dict(message))
