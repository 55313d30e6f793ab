"""Outgoing webhooks, one system for every event: billing's (``invoice.finalized``,
``usage.closed``), the sandboxes' (``sandbox.stopped``) and the alerts'
(``alert.raised``, ``alert.cleared``).

The app that owns a fact builds its payload and calls ``emit()`` inside the transaction
that makes the fact true: one ``WebhookDelivery`` per matching endpoint, and
``workers.control.deliver_webhook`` enqueued after commit. The task calls
``attempt_delivery()``: one signed POST, recorded on the row whatever the outcome, and on
failure the delay until the next try (exponential backoff with jitter, MAX_ATTEMPTS in
all, about an hour), which the task turns into a Celery retry. A redirect is such a failure
(never followed); a URL leading where webhooks may not go (``destinations``: loopback,
private networks, the metadata service) is given up at once. ``webhook_tick()`` re-sends
what is overdue (a retry lost with a worker); ``do_redeliver()`` sends one again.

The body::

    {"id": "<event uuid>", "event": "usage.closed", "created_at": "<ISO 8601>", "data": {...}}

signed the Standard Webhooks way (https://www.standardwebhooks.com, the ``standardwebhooks``
library): ``webhook-id`` (the event uuid, which is also the body's ``id``: the key
receivers dedupe on, the same on every retry and redelivery), ``webhook-timestamp`` (the
attempt's Unix time) and ``webhook-signature`` (``v1,<base64 HMAC-SHA256 of
"id.timestamp.body">``, one per valid secret, space-separated: two while a rotated-out
secret's grace lasts). ``X-Gpushare-Event`` names the event. A receiver verifies with
``standardwebhooks.Webhook(secret).verify(body, headers)``.

An event id derives from a key naming the fact (``usage.closed:<record id>``), so the same
fact emitted twice makes one delivery per endpoint, not two.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from standardwebhooks import Webhook

from portal.webhooks import destinations
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent, new_secret, secret_key
from wire import dispatch
from wire.messages import to_control

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
BACKOFF_BASE_S = 30.0  # waits 30 s, 1, 2, 4, 8, 16, 32 min (+-20 %): about 63 min in all
BACKOFF_MAX_S = 1920.0
TIMEOUT_S = 5
LOG_KEEP = 30  # attempts kept in attempt_log (the counter keeps counting)
USER_AGENT = "gpushare-webhooks"
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
    global ones; ``project`` None: the global ones only) and enqueue delivery after commit.
    With ``key``, emitting again makes no new delivery. Call inside the transaction that
    makes the fact true."""
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


def signature_headers(secrets: list[str], msg_id: str, data: bytes, at: datetime) -> dict[str, str]:
    """The Standard Webhooks headers: a ``v1`` signature under each secret (ValueError
    when one is not a ``whsec_`` secret)."""
    at = at.astimezone(UTC).replace(microsecond=0)
    text = data.decode()
    signatures = " ".join(Webhook(secret_key(s)).sign(msg_id, at, text) for s in secrets)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signatures,
    }


def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int | None, str]:
    """The one HTTP client of webhooks: POST ``data``; (HTTP status or None, error text).
    A redirect is an error like a 4xx: it is not followed (see ``destinations``).
    RefusedDestination when the URL leads where webhooks may not go."""
    try:
        status = destinations.post(url, data, headers, TIMEOUT_S)
    except OSError as exc:
        return None, str(exc)[:300]
    if 200 <= status < 300:
        return status, ""
    if 300 <= status < 400:
        return status, f"HTTP {status}: redirects are not followed"
    return status, f"HTTP {status}"


def attempt_delivery(delivery_id: int, now: datetime | None = None) -> float | None:
    """Try one delivery now; returns seconds until the next try, or None when there is
    nothing more to do (delivered, given up, gone, not due, or another worker holds it).

    ``now`` is the schedule's clock (what is due, when to retry); the signature's timestamp
    is always the wall clock, as receivers check it against theirs.

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
        signed_at = timezone.now()
        try:
            signed = signature_headers(
                endpoint.signing_secrets(signed_at), str(delivery.event_id), data, signed_at
            )
        except ValueError as exc:  # a secret set by hand, not whsec_<base64>: no retry mends it
            delivery.next_attempt_at, delivery.last_error = None, f"endpoint secret: {exc}"[:300]
            delivery.save(update_fields=["next_attempt_at", "last_error"])
            return None
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Gpushare-Event": delivery.event,
            **signed,
        }
        started = time.monotonic()
        refused = False
        try:
            status, error = post(endpoint.url, data, headers)
        except destinations.RefusedDestination as exc:
            # Not sent at all. No retry: the same checks would refuse it again (a redelivery,
            # after the endpoint or WEBHOOK_ALLOWED_NETWORKS changed, tries anew).
            status, error, refused = None, f"refused: {exc}"[:300], True
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
        elif refused or delivery.attempts >= MAX_ATTEMPTS:
            delivery.next_attempt_at = None
            log.warning(
                "webhook %s to %s given up after %d attempts: %s",
                delivery.event_id,
                endpoint.url,
                delivery.attempts,
                delivery.last_error,
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
        transaction.on_commit(functools.partial(dispatch.to_control, "deliver_webhook", locked.pk))


def webhook_tick(now: datetime, overdue: timedelta = timedelta(minutes=5)) -> int:
    """Re-enqueue deliveries whose retry is overdue (its message lost with a worker);
    attempt_delivery's lock and due check make an extra message harmless."""
    due = list(
        WebhookDelivery.objects.filter(delivered_at__isnull=True, next_attempt_at__lte=now - overdue)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:500]
    )
    for pk in due:
        to_control.deliver_webhook(pk)
    return len(due)


def do_rotate_secret(
    endpoint: WebhookEndpoint, grace: timedelta, now: datetime | None = None
) -> WebhookEndpoint:
    """Give the endpoint a new secret; the current one stays valid (deliveries carry a
    signature under each) for ``grace``, so its receiver can switch over. A secret rotated
    out earlier whose grace still runs is dropped: only the latest previous one is kept.
    A zero grace retires the current secret at once."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
        if grace > timedelta(0):
            locked.previous_secret, locked.previous_secret_expires_at = locked.secret, now + grace
        else:
            locked.previous_secret, locked.previous_secret_expires_at = "", None
        locked.secret = new_secret()
        locked.save(update_fields=["secret", "previous_secret", "previous_secret_expires_at"])
    log.info("webhook endpoint %s: secret rotated, the previous one valid for %s", locked.pk, grace)
    return locked
