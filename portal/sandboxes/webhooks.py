"""The ``sandbox.stopped`` webhook event: its payload, emitted by ``actions`` when a sandbox
moves into an end state (stopped, failed, preempted, expired)."""

from __future__ import annotations

from typing import Any

from portal.sandboxes.models import Sandbox, SandboxEvent
from portal.webhooks.deliveries import emit
from portal.webhooks.models import WebhookEvent


def stopped_payload(sandbox: Sandbox, event: SandboxEvent) -> dict[str, Any]:
    return {
        "sandbox_id": sandbox.pk,
        "name": sandbox.name,
        "project_id": sandbox.project_id,
        "owner_id": sandbox.owner_id,
        "tier_id": sandbox.tier_id,
        "state": event.to_state,
        "from_state": event.from_state,
        "at": event.at.isoformat(),
        "message": event.message,
    }


def emit_stopped(sandbox: Sandbox, event: SandboxEvent) -> None:
    """End states are final, so the event is keyed by the sandbox: once per sandbox."""
    emit(
        WebhookEvent.SANDBOX_STOPPED,
        stopped_payload(sandbox, event),
        sandbox.project_id,
        key=f"sandbox.stopped:{sandbox.pk}",
    )
