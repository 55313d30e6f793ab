"""Alerts on the control side: the policy agents evaluate, storing what they raise and
clear, and the signed webhook that tells an operator's tooling.

Agents run the rules (workers/alerts.py); here a raised alert becomes a row (once, keyed
by the agent's key), its clearing closes that row, a sandbox's owner is notified, and the
fleet's (and the tier's) webhook gets a signed POST, retried with backoff by Celery.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.fleet.models import Gpu, Host
from portal.sandboxes.models import Notification, Sandbox
from portal.sandboxes.notify import notify
from portal.telemetry.models import Alert, AlertPolicy

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


def do_record_alerts(host: str, changes: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """Store raised alerts and close cleared ones; returns (alert id, state) of each row that
    changed, for the webhook. A change seen before (redelivered) changes nothing."""
    host_row = Host.objects.filter(name=host).first()
    if host_row is None:
        log.warning("alerts from unknown host %s ignored", host)
        return []
    changed: list[tuple[int, str]] = []
    with transaction.atomic():
        for change in changes:
            key, kind = str(change.get("key", ""))[:200], change.get("kind")
            if not key or kind not in KINDS:
                log.warning(
                    "alert change from %s without a key or with an unknown kind ignored: %s", host, change
                )
                continue
            if change.get("state") == "raised":
                alert = _raise(host_row, key, kind, change)
                if alert is not None:
                    changed.append((alert.pk, "raised"))
            elif change.get("state") == "cleared":
                at = _when(change.get("t"))
                reason = str(change.get("message", ""))[:120]
                open_alert = Alert.objects.filter(key=key, cleared_at__isnull=True).first()
                if open_alert is not None:
                    open_alert.cleared_at, open_alert.clear_reason = at, reason
                    open_alert.save(update_fields=["cleared_at", "clear_reason"])
                    changed.append((open_alert.pk, "cleared"))
    for alert_id, state in changed:
        transaction.on_commit(functools.partial(_send_webhooks, alert_id, state))
    return changed


def _raise(host: Host, key: str, kind: str, change: dict[str, Any]) -> Alert | None:
    if Alert.objects.filter(key=key).exists():
        return None
    gpu = Gpu.objects.filter(uuid=change.get("gpu", "")).first()
    sandbox_id = change.get("sandbox")
    sandbox = Sandbox.objects.filter(pk=sandbox_id).select_related("owner").first() if sandbox_id else None
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
        notify(sandbox.owner, Notification.Kind.ALERT, alert.message, sandbox)
    return alert


def do_close_host_alerts(host: str, reason: str) -> int:
    """An agent restarted: the alerts it had raised can no longer clear themselves; it raises
    again whatever is still true."""
    return Alert.objects.filter(host__name=host, cleared_at__isnull=True).update(
        cleared_at=timezone.now(), clear_reason=reason[:120]
    )


# --- webhooks ----------------------------------------------------------------------------


def webhook_body(alert: Alert, state: str) -> bytes:
    payload = {
        "event": f"alert.{state}",
        "alert": {
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
        },
    }
    return json.dumps(payload, sort_keys=True).encode()


def signature(body: bytes, secret: str) -> str:
    """``X-Gpushare-Signature``: ``sha256=<hex HMAC of the body>``, as GitHub signs its hooks."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def webhook_urls(alert: Alert) -> list[str]:
    """The fleet's webhook, and the tier's for a sandbox's alert (each URL once)."""
    urls = list(
        AlertPolicy.objects.filter(tier__isnull=True)
        .exclude(webhook_url="")
        .values_list("webhook_url", flat=True)
    )
    if alert.sandbox_id is not None:
        tier_url = (
            AlertPolicy.objects.filter(tier__sandboxes=alert.sandbox_id)
            .exclude(webhook_url="")
            .values_list("webhook_url", flat=True)
            .first()
        )
        if tier_url and tier_url not in urls:
            urls.append(tier_url)
    return urls


def _send_webhooks(alert_id: int, state: str) -> None:
    alert = Alert.objects.filter(pk=alert_id).first()
    if alert is None:
        return
    from workers import dispatch

    for url in webhook_urls(alert):
        dispatch.to_control("deliver_alert_webhook", alert_id, state, url)


def note_delivery(alert_id: int, status: str) -> None:
    Alert.objects.filter(pk=alert_id).update(webhook_status=status[:120])


def secret() -> str:
    return str(settings.ALERT_WEBHOOK_SECRET)
