"""Outgoing webhooks: ``invoice.finalized``, ``sandbox.stopped``, ``usage.closed``.

``emit()`` writes one ``WebhookDelivery`` per matching endpoint inside the caller's
transaction and enqueues ``workers.control.deliver_webhook`` after commit. The task calls
``attempt_delivery()``: one signed POST, recorded on the row whatever the outcome, and on
failure the delay until the next try (exponential backoff with jitter, MAX_ATTEMPTS in
all, about an hour), which the task turns into a Celery retry. ``webhook_tick()`` re-sends
what is overdue (a retry lost with a worker).

The body::

    {"id": "<event uuid>", "event": "usage.closed", "created_at": "<ISO 8601>", "data": {...}}

with headers ``X-Gpushare-Event``, ``X-Gpushare-Delivery`` (the event uuid, which is also
the body's ``id``: the idempotency key receivers dedupe on, the same on every retry and
redelivery) and ``X-Gpushare-Signature: sha256=<hex HMAC-SHA256 of the body with the
endpoint's secret>``, computed by ``portal.telemetry.alerts.signature`` as for alerts.

An event id derives from a key naming the fact (``usage.closed:<record id>``), so the same
fact emitted twice makes one delivery per endpoint, not two.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.signals import post_save
from django.utils import timezone

from portal.billing.models import UsageRecord, WebhookDelivery, WebhookEndpoint, WebhookEvent
from portal.telemetry.alerts import signature
from workers import dispatch

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
BACKOFF_BASE_S = 30.0  # waits 30 s, 1, 2, 4, 8, 16, 32 min (+-20 %): about 63 min in all
BACKOFF_MAX_S = 1920.0
TIMEOUT_S = 5
LOG_KEEP = 30  # attempts kept in attempt_log (the counter keeps counting)
_EVENT_NAMESPACE = uuid.UUID("5f1d6c1e-4b8a-4f4e-9a0e-6770757368ab")


def event_uuid(key: str) -> uuid.UUID:
    return uuid.uuid5(_EVENT_NAMESPACE, key)


def backoff_seconds(attempts: int) -> float:
    """Delay after the ``attempts``-th failed try: base x 2^(n-1), capped, +-20 % jitter
    so endpoints that failed together do not all retry together."""
    delay = min(BACKOFF_BASE_S * 2 ** max(attempts - 1, 0), BACKOFF_MAX_S)
    return delay * random.uniform(0.8, 1.2)  # noqa: S311 - jitter, not a secret


def endpoints_for(event: str, project_id: int | None) -> list[WebhookEndpoint]:
    # Endpoints are few: their event lists are filtered here, which works on SQLite too
    # (no JSON containment lookup there).
    scope = Q(project__isnull=True) | Q(project_id=project_id) if project_id else Q(project__isnull=True)
    return [e for e in WebhookEndpoint.objects.filter(scope, active=True) if event in (e.events or [])]


def emit(event: str, payload: dict[str, Any], project: Any, key: str | None = None) -> list[WebhookDelivery]:
    """Record ``event`` for every active endpoint that wants it (the project's and the
    global ones) and enqueue delivery after commit. With ``key``, emitting again makes no
    new delivery. Call inside the transaction that makes the fact true."""
    if event not in WebhookEvent.values:
        raise ValueError(f"unknown webhook event {event!r}")
    project_id = getattr(project, "pk", project)
    event_id = event_uuid(key) if key else uuid.uuid4()
    created: list[WebhookDelivery] = []
    now = timezone.now()
    for endpoint in endpoints_for(event, project_id):
        delivery, new = WebhookDelivery.objects.get_or_create(
            endpoint=endpoint,
            event_id=event_id,
            defaults={"event": event, "payload": payload, "created_at": now, "next_attempt_at": now},
        )
        if new:
            created.append(delivery)
    for delivery in created:
        transaction.on_commit(functools.partial(dispatch.to_control, "deliver_webhook", delivery.pk))
    return created


def body(delivery: WebhookDelivery) -> bytes:
    document = {
        "id": str(delivery.event_id),
        "event": delivery.event,
        "created_at": delivery.created_at.isoformat(),
        "data": delivery.payload,
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int | None, str]:
    """(HTTP status or None, error text)."""
    if not url.startswith(("http://", "https://")):
        return None, f"not an http(s) URL: {url}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")  # noqa: S310 - scheme checked
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - scheme checked
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return None, str(getattr(exc, "reason", exc))[:300]


def attempt_delivery(delivery_id: int, now: datetime | None = None) -> float | None:
    """Try one delivery now; returns seconds until the next try, or None when there is
    nothing more to do (delivered, given up, gone, not due, or another worker holds it).

    Holds the delivery's row lock (skip_locked) for the POST, at most TIMEOUT_S, so two
    workers never send the same delivery at once.
    """
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("endpoint")
            .filter(pk=delivery_id)
            .first()
        )
        now = now or timezone.now()
        if delivery is None or delivery.delivered_at is not None or delivery.next_attempt_at is None:
            return None
        if delivery.next_attempt_at > now + timedelta(seconds=1):
            return None  # an early duplicate message: the scheduled retry will come
        endpoint = delivery.endpoint
        if not endpoint.active:
            delivery.next_attempt_at, delivery.last_error = None, "endpoint inactive"
            delivery.save(update_fields=["next_attempt_at", "last_error"])
            return None
        data = body(delivery)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gpushare-webhooks",
            "X-Gpushare-Event": delivery.event,
            "X-Gpushare-Delivery": str(delivery.event_id),
            "X-Gpushare-Signature": signature(data, endpoint.secret),
        }
        started = time.monotonic()
        status, error = _post(endpoint.url, data, headers)
        elapsed_ms = int((time.monotonic() - started) * 1000)
        ok = status is not None and 200 <= status < 300
        delivery.attempts += 1
        delivery.last_status = status
        delivery.last_error = "" if ok else error or f"HTTP {status}"
        entry = {"at": now.isoformat(), "status": status, "error": delivery.last_error, "ms": elapsed_ms}
        delivery.attempt_log = [*delivery.attempt_log, entry][-LOG_KEEP:]
        delay: float | None = None
        if ok:
            delivery.delivered_at, delivery.next_attempt_at = now, None
        elif delivery.attempts >= MAX_ATTEMPTS:
            delivery.next_attempt_at = None
            log.warning(
                "webhook %s to %s given up after %d attempts", delivery.event_id, endpoint.url, MAX_ATTEMPTS
            )
        else:
            delay = backoff_seconds(delivery.attempts)
            delivery.next_attempt_at = now + timedelta(seconds=delay)
            log.info(
                "webhook %s to %s failed (%s), retry in %.0f s", delivery.event_id, endpoint.url, error, delay
            )
        delivery.save(
            update_fields=[
                "attempts",
                "last_status",
                "last_error",
                "attempt_log",
                "delivered_at",
                "next_attempt_at",
            ]
        )
        return delay


def do_redeliver(delivery: WebhookDelivery) -> None:
    """Send again (admin action), with the same event id so the receiver can dedupe: a new
    round of MAX_ATTEMPTS tries; the attempt log keeps the earlier ones."""
    with transaction.atomic():
        locked = WebhookDelivery.objects.select_for_update().get(pk=delivery.pk)
        locked.delivered_at, locked.attempts, locked.next_attempt_at = None, 0, timezone.now()
        locked.save(update_fields=["delivered_at", "attempts", "next_attempt_at"])
        transaction.on_commit(lambda: dispatch.to_control("deliver_webhook", locked.pk))


def webhook_tick(now: datetime, overdue: timedelta = timedelta(minutes=5)) -> int:
    """Re-enqueue deliveries whose retry is overdue (its message lost with a worker);
    attempt_delivery's lock and due check make an extra message harmless."""
    due = list(
        WebhookDelivery.objects.filter(delivered_at__isnull=True, next_attempt_at__lte=now - overdue)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:500]
    )
    for pk in due:
        dispatch.to_control("deliver_webhook", pk)
    return len(due)


def usage_payload(record: UsageRecord) -> dict[str, Any]:
    return {
        "usage_record_id": record.pk,
        "sandbox_id": record.sandbox_id,
        "project_id": record.project_id,
        "user_id": record.user_id,
        "tier_id": record.tier_id,
        "gpu_model": record.gpu_model,
        "milli_gpu": record.milli_gpu,
        "billed_milli": record.priced_milli,
        "started_at": record.started_at.isoformat(),
        "ended_at": record.ended_at.isoformat() if record.ended_at else None,
        "duration_seconds": record.duration.total_seconds() if record.duration is not None else None,
        "price_per_gpu_hour_micros": record.price_per_gpu_hour_micros,
        "cost_micros": record.cost_micros,
        "currency": record.currency,
    }


def _on_usage_saved(sender: Any, instance: UsageRecord, created: bool, update_fields: Any, **_: Any) -> None:
    """``usage.closed`` when the ledger closes an interval (close_interval saves with
    update_fields=[ended_at, ...]); keyed by the record, so once per record."""
    if instance.ended_at is None or instance.cost_micros is None:
        return
    if not created and update_fields is not None and "ended_at" not in update_fields:
        return
    emit(
        WebhookEvent.USAGE_CLOSED,
        usage_payload(instance),
        instance.project_id,
        key=f"usage.closed:{instance.pk}",
    )


def _on_sandbox_event_saved(sender: Any, instance: Any, created: bool, **_: Any) -> None:
    """``sandbox.stopped`` on the transition into an end state (stopped, failed, preempted,
    expired); end states are final, so it is keyed by the sandbox: once per sandbox."""
    from portal.sandboxes.models import ENDED_STATES

    if not created or instance.to_state not in ENDED_STATES:
        return
    sandbox = instance.sandbox
    payload = {
        "sandbox_id": sandbox.pk,
        "name": sandbox.name,
        "project_id": sandbox.project_id,
        "owner_id": sandbox.owner_id,
        "tier_id": sandbox.tier_id,
        "state": instance.to_state,
        "from_state": instance.from_state,
        "at": instance.at.isoformat(),
        "message": instance.message,
    }
    emit(WebhookEvent.SANDBOX_STOPPED, payload, sandbox.project_id, key=f"sandbox.stopped:{sandbox.pk}")


def connect() -> None:
    """Wire the receivers (BillingConfig.ready): the ledger and the sandbox actions stay
    unaware of webhooks."""
    from portal.sandboxes.models import SandboxEvent

    post_save.connect(_on_usage_saved, sender=UsageRecord, dispatch_uid="billing.webhooks.usage_closed")
    post_save.connect(
        _on_sandbox_event_saved, sender=SandboxEvent, dispatch_uid="billing.webhooks.sandbox_stopped"
    )
