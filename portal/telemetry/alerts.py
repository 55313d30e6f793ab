"""Alerts on the control side: the policy agents evaluate, storing what they raise and
clear, and the webhook events that tell an operator's tooling.

Agents run the rules (workers/host/alerts.py); here a raised alert becomes a row (once, keyed
by the agent's key), its clearing closes that row, a sandbox's owner is notified, and an
``alert.raised`` / ``alert.cleared`` webhook event is emitted (``portal.webhooks``: every
endpoint subscribed to it, the global ones and, for a sandbox's alert, its project's;
signed, recorded, retried and redeliverable like every other webhook).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Notification, Sandbox
from portal.sandboxes.notify import notify_owner
from portal.telemetry.models import Alert, AlertPolicy
from portal.webhooks.deliveries import emit
from portal.webhooks.models import WebhookEvent
from wire.telemetry import AlertMessage

log = logging.getLogger(__name__)
KINDS = {k.value for k in Alert.Kind}


def alert_policy() -> dict[str, Any]:
    """The thresholds for agents: the fleet's and every tier's, with a version that changes
    whenever any of them does (the heartbeat compares it)."""
    fleet: dict[str, Any] = AlertPolicy().rules()
    tiers: dict[str, dict[str, Any]] = {}
    for policy in AlertPolicy.objects.select_related("tier").order_by("pk"):
        if policy.tier is None:
            fleet = policy.rules()
        else:
            tiers[policy.tier.slug] = policy.rules()
    body = {"fleet": fleet, "tiers": tiers}
    version = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {"version": version, **body}


def _when(t_ms: Any) -> datetime:
    try:
        return datetime.fromtimestamp(int(t_ms) / 1000, tz=UTC)
    except (TypeError, ValueError, OverflowError):
        return timezone.now()


def do_record_alerts(host: str, changes: list[AlertMessage]) -> list[tuple[int, str]]:
    """Store raised alerts and close cleared ones; returns (alert id, state) of each row that
    changed. A change seen before (redelivered) changes nothing; each change emits its
    webhook event in the same transaction."""
    host_row = Host.objects.filter(name=host).first()
    if host_row is None:
        log.warning("alerts from unknown host %s ignored", host)
        return []
    changed: list[tuple[int, str]] = []
    with transaction.atomic():
        for change in changes:
            key, kind = str(change.get("key", ""))[:200], change.get("kind")
            if not key or kind not in KINDS or kind == Alert.Kind.FORGED:
                log.warning(
                    "alert change from %s without a key or with an unknown kind ignored: %s", host, change
                )
                continue
            # A host speaks for itself alone (issue 38): its agent makes every key under its
            # name, so it can neither clear another host's alerts nor take their keys first.
            if not key.startswith(f"{host}:"):
                log.warning("alert change from %s with another host's key ignored: %s", host, key)
                continue
            if change.get("state") == "raised":
                alert = _raise(host_row, key, kind, change)
                if alert is not None:
                    emit_alert_event(alert, "raised")
                    changed.append((alert.pk, "raised"))
            elif change.get("state") == "cleared":
                at = _when(change.get("t"))
                reason = str(change.get("message", ""))[:120]
                open_alert = Alert.objects.filter(key=key, host=host_row, cleared_at__isnull=True).first()
                if open_alert is not None:
                    open_alert.cleared_at, open_alert.clear_reason = at, reason
                    open_alert.save(update_fields=["cleared_at", "clear_reason"])
                    emit_alert_event(open_alert, "cleared")
                    changed.append((open_alert.pk, "cleared"))
    return changed


def _raise(host: Host, key: str, kind: str, change: AlertMessage) -> Alert | None:
    if Alert.objects.filter(key=key).exists():
        return None
    # Only its own GPU and a sandbox placed on it: another's would notify a stranger.
    gpu = Gpu.objects.filter(uuid=change.get("gpu", ""), host=host).first()
    sandbox_id = change.get("sandbox")
    sandbox = (
        Sandbox.objects.filter(pk=sandbox_id, host=host).select_related("owner").first()
        if sandbox_id
        else None
    )
    alert = Alert.objects.create(
        key=key,
        kind=kind,
        host=host,
        gpu=gpu,
        sandbox=sandbox,
        message=str(change.get("message", ""))[:300],
        value=float(change.get("value") or 0),
        threshold=float(change.get("threshold") or 0),
        raised_at=_when(change.get("t")),
    )
    if sandbox is not None:
        notify_owner(sandbox, Notification.Kind.ALERT, alert.message)
    return alert


# Raised by the control worker about a host, never cleared by its agent: an operator
# clears them, once they have looked.
CONTROL_KINDS = (Alert.Kind.FORGED, Alert.Kind.ACCOUNTING)


def do_raise_forgery_alert(host: Host, key: str, message: str) -> Alert | None:
    """A forged message, attributed to ``host`` (the one whose key signed it, else the one it
    claimed to be): ``do_raise_control_alert``, keyed by the caller by signer and hour, so a
    host that keeps forging raises one an hour, not one a message."""
    return do_raise_control_alert(Alert.Kind.FORGED, host, key, message)


def do_raise_control_alert(
    kind: str, host: Host, key: str, message: str, sandbox_id: int | None = None, value: float = 1.0
) -> Alert | None:
    """An alert the control worker raises (one of ``CONTROL_KINDS``): open, with its
    ``alert.raised`` event, once per ``key``. No agent clears it."""
    with transaction.atomic():
        alert, created = Alert.objects.get_or_create(
            key=key[:200],
            defaults={
                "kind": kind,
                "host": host,
                "sandbox_id": sandbox_id,
                "message": message[:300],
                "value": value,
                "threshold": 0.0,
                "raised_at": timezone.now(),
            },
        )
        if not created:
            return None
        emit_alert_event(alert, "raised")
    return alert


def do_close_host_alerts(hosts: Collection[str], reason: str) -> int:
    """Agents restarted: the alerts they had raised can no longer clear themselves; each
    raises again whatever is still true. One statement however many hosts."""
    if not hosts:
        return 0
    # A forged message's or an accounting mismatch's alert is the control worker's, not the
    # agent's: an agent restarted (by whoever holds its host) does not close it.
    opened = Alert.objects.filter(host__name__in=list(hosts), cleared_at__isnull=True)
    return opened.exclude(kind__in=CONTROL_KINDS).update(cleared_at=timezone.now(), clear_reason=reason[:120])


# --- webhooks ----------------------------------------------------------------------------

ALERT_EVENTS = {"raised": WebhookEvent.ALERT_RAISED, "cleared": WebhookEvent.ALERT_CLEARED}


def alert_payload(alert: Alert, state: str) -> dict[str, Any]:
    return {
        "alert_id": alert.pk,
        "key": alert.key,
        "kind": alert.kind,
        "state": state,
        "message": alert.message,
        "value": alert.value,
        "threshold": alert.threshold,
        "host": alert.host.name,
        "gpu": alert.gpu.uuid if alert.gpu else None,
        "sandbox": alert.sandbox_id,
        "raised_at": alert.raised_at.isoformat(),
        "cleared_at": alert.cleared_at.isoformat() if alert.cleared_at else None,
    }


def emit_alert_event(alert: Alert, state: str) -> None:
    """``alert.raised`` / ``alert.cleared`` to the global endpoints that want it and, for a
    sandbox's alert, its project's; keyed by the alert, so once per alert and state."""
    project_id = alert.sandbox.project_id if alert.sandbox is not None else None
    emit(ALERT_EVENTS[state], alert_payload(alert, state), project_id, key=f"alert.{state}:{alert.pk}")
