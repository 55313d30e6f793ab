"""Webhooks (portal.webhooks), one system for billing, sandbox and alert events: emitted
once per fact, signed the Standard Webhooks way and verified here by the reference
verifier, secrets rotated with a grace period, retried with backoff, every attempt
recorded, visible and redeliverable in the admin; no post_save signal behind any of it."""

from __future__ import annotations

import base64
import importlib
import ipaddress
import itertools
import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.core.exceptions import ValidationError
from django.db.models.signals import post_save
from django.urls import reverse
from django.utils import timezone
from standardwebhooks import Webhook, WebhookVerificationError

from portal.billing import ledger
from portal.billing.models import UsageRecord
from portal.fleet.models import Host
from portal.sandboxes import actions
from portal.sandboxes.models import SandboxEvent
from portal.telemetry.alerts import do_record_alerts
from portal.webhooks import deliveries
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint, new_secret
from tests.portal.helpers import client_for, place_all, request
from wire.telemetry import AlertMessage

ALERTS = ["alert.raised", "alert.cleared"]


class Receiver:
    """A local HTTP endpoint answering the queued statuses (then 200), keeping what it got."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                # Header names are case-insensitive (urllib sends "Webhook-id"): kept lowercase.
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def loopback_allowed(settings: Any) -> None:
    """The receivers here listen on loopback, which webhooks reach only when the operator
    allows it (tests/portal/webhooks/test_webhook_destinations.py: refused by default)."""
    settings.WEBHOOK_ALLOWED_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.fixture
def receiver(loopback_allowed: None) -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def sandbox(people: Any, catalog: Any, sent_tasks: Any) -> Any:
    return request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])


START = timezone.now().replace(microsecond=0) - timedelta(days=1)


def open_usage(sandbox: Any, key: str = "k1") -> UsageRecord:
    return UsageRecord.objects.create(
        sandbox=sandbox,
        allocation_key=key,
        project=sandbox.project,
        user=sandbox.owner,
        tier=sandbox.tier,
        gpu_model="H100-80GB",
        milli_gpu=1000,
        price_per_gpu_hour_micros=2_500_000,
        currency="EUR",
        started_at=START,
    )


def close(key: str = "k1") -> UsageRecord | None:
    # One hour of a whole GPU at 2.50/GPU-h.
    return ledger.close_interval(SimpleNamespace(allocation_key=key), START + timedelta(hours=1))  # type: ignore[arg-type]


def verified(secret: str, headers: dict[str, str], body: bytes) -> Any:
    """What a receiver does: the reference verifier (headers, timestamp, signature)."""
    return Webhook(secret).verify(body, headers)


def test_usage_closed_is_signed_and_delivered(
    sandbox: Any, receiver: Receiver, sent_tasks: Any, django_capture_on_commit_callbacks: Any
) -> None:
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed"])
    assert endpoint.secret.startswith("whsec_") and len(base64.b64decode(endpoint.secret[6:])) == 32
    record = open_usage(sandbox)
    assert not WebhookDelivery.objects.exists()  # opening is not an event
    with django_capture_on_commit_callbacks(execute=True):
        close()
    [delivery] = WebhookDelivery.objects.all()
    assert ("control", "deliver_webhook", (delivery.pk,)) in sent_tasks  # enqueued after commit
    assert deliveries.attempt_delivery(delivery.pk) is None
    [(headers, body)] = receiver.received
    document = verified(endpoint.secret, headers, body)
    assert document["id"] == str(delivery.event_id) == headers["webhook-id"]
    assert document["event"] == "usage.closed" == headers["x-gpushare-event"]
    assert abs(int(headers["webhook-timestamp"]) - timezone.now().timestamp()) < 60
    record.refresh_from_db()
    assert document["data"]["usage_record_id"] == record.pk
    assert document["data"]["cost_micros"] == record.cost_micros == 2_500_000
    with pytest.raises(WebhookVerificationError):
        verified(new_secret(), headers, body)  # another key
    with pytest.raises(WebhookVerificationError):
        verified(endpoint.secret, headers, body.replace(b"2500000", b"2500001"))  # another body
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and delivery.attempts == 1 and delivery.last_status == 200
    assert deliveries.attempt_delivery(delivery.pk) is None and len(receiver.received) == 1  # not twice


def alert_change(state: str, key: str, **extra: Any) -> AlertMessage:
    return cast(AlertMessage, {
        "type": "alert.changed", "key": key, "state": state, "kind": "temperature", "host": "h100",
        "gpu": "", "sandbox": None, "value": 88.0, "threshold": 85.0, "message": "GPU hot",
        "t": 1_700_000_000_000, **extra,
    })  # fmt: skip


def test_alert_events_go_through_the_same_deliveries(
    sandbox: Any,
    fleet: Any,
    people: Any,
    receiver: Receiver,
    sent_tasks: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    """An alert raised and cleared: delivery rows like billing's, signed alike, verified
    alike; a project's endpoint gets the alerts on its sandboxes, not the GPU's own."""
    fleet_hook = WebhookEndpoint.objects.create(url=receiver.url, events=ALERTS)
    billing_hook = WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed"])
    project_hook = WebhookEndpoint.objects.create(url=receiver.url, events=ALERTS, project=people["project"])
    # A host's alert names only a sandbox placed on that host.
    type(sandbox).objects.filter(pk=sandbox.pk).update(host=Host.objects.get(name="h100"))
    with django_capture_on_commit_callbacks(execute=True):
        do_record_alerts(
            "h100", [alert_change("raised", "h100:a1"), alert_change("raised", "h100:a2", sandbox=sandbox.pk)]
        )
        do_record_alerts("h100", [alert_change("raised", "h100:a1")])  # redelivered: nothing new
        do_record_alerts("h100", [alert_change("cleared", "h100:a1", message="cleared: back to normal")])
    rows = WebhookDelivery.objects.order_by("pk")
    assert [(d.event, d.payload["key"], d.endpoint_id) for d in rows] == [
        ("alert.raised", "h100:a1", fleet_hook.pk),
        ("alert.raised", "h100:a2", fleet_hook.pk),
        ("alert.raised", "h100:a2", project_hook.pk),
        ("alert.cleared", "h100:a1", fleet_hook.pk),
    ]
    assert billing_hook.deliveries.count() == 0
    assert [t[1] for t in sent_tasks if t[1].startswith("deliver")] == ["deliver_webhook"] * 4
    for delivery in rows:
        assert deliveries.attempt_delivery(delivery.pk) is None
    for (headers, body), delivery in zip(receiver.received, rows, strict=True):
        document = verified(delivery.endpoint.secret, headers, body)
        assert document["event"] == delivery.event and document["id"] == headers["webhook-id"]
    cleared = json.loads(receiver.received[-1][1])["data"]
    assert cleared["state"] == "cleared" and cleared["cleared_at"] and cleared["host"] == "h100"
    assert json.loads(receiver.received[1][1])["data"]["sandbox"] == sandbox.pk


def test_a_rotated_secret_keeps_the_old_one_valid_for_the_grace(sandbox: Any, receiver: Receiver) -> None:
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed", *ALERTS])
    old = endpoint.secret
    endpoint = deliveries.do_rotate_secret(endpoint, timedelta(hours=24))
    new = endpoint.secret
    assert new != old and endpoint.previous_secret == old
    open_usage(sandbox)
    close()
    deliveries.attempt_delivery(WebhookDelivery.objects.get().pk)
    [(headers, body)] = receiver.received
    assert len(headers["webhook-signature"].split(" ")) == 2  # one per valid secret
    assert verified(new, headers, body)["event"] == "usage.closed"
    assert verified(old, headers, body)["event"] == "usage.closed"  # within the grace

    # Rotated again 25 hours ago with a 24-hour grace: only the newest secret signs.
    endpoint = deliveries.do_rotate_secret(
        endpoint, timedelta(hours=24), now=timezone.now() - timedelta(hours=25)
    )
    newest = endpoint.secret
    open_usage(sandbox, "k2")
    close("k2")
    deliveries.attempt_delivery(WebhookDelivery.objects.get(attempts=0).pk)
    headers, body = receiver.received[-1]
    assert len(headers["webhook-signature"].split(" ")) == 1
    assert verified(newest, headers, body)["event"] == "usage.closed"
    for retired in (new, old):
        with pytest.raises(WebhookVerificationError):
            verified(retired, headers, body)

    # No grace: the old secret stops at once.
    endpoint = deliveries.do_rotate_secret(endpoint, timedelta(0))
    assert endpoint.previous_secret == "" and endpoint.signing_secrets(timezone.now()) == [endpoint.secret]


def test_admin_rotates_a_secret_with_the_configured_grace(people: Any, settings: Any) -> None:
    settings.WEBHOOK_SECRET_GRACE_HOURS = 2
    endpoint = WebhookEndpoint.objects.create(url="http://a.invalid/", events=["usage.closed"])
    old = endpoint.secret
    admin = client_for(people["admin"])
    changelist = reverse("admin:webhooks_webhookendpoint_changelist")
    response = admin.post(
        changelist, {"action": "rotate_secret", "_selected_action": [endpoint.pk]}, follow=True
    )
    assert "valid for 2 h" in response.content.decode()
    endpoint.refresh_from_db()
    assert endpoint.secret != old and endpoint.previous_secret == old
    assert endpoint.previous_secret_expires_at is not None
    left = endpoint.previous_secret_expires_at - timezone.now()
    assert timedelta(hours=1, minutes=59) < left <= timedelta(hours=2)
    assert admin.get(changelist).status_code == 200
    page = admin.get(reverse("admin:webhooks_webhookendpoint_change", args=[endpoint.pk])).content.decode()
    assert "previous secret valid until" in page.lower() and endpoint.secret in page
    assert old not in page  # the retired secret is not shown again


def test_a_secret_must_be_a_standard_webhooks_one(db: Any) -> None:
    for bad in ("plain-text", "whsec_not base64!", "whsec_"):
        with pytest.raises(ValidationError) as error:
            WebhookEndpoint(url="http://a.invalid/", secret=bad, events=["usage.closed"]).full_clean()
        assert set(error.value.message_dict) == {"secret"}
    WebhookEndpoint(url="http://a.invalid/", events=[*ALERTS]).full_clean()


def test_a_malformed_secret_gives_up_without_sending(sandbox: Any, receiver: Receiver) -> None:
    WebhookEndpoint.objects.create(url=receiver.url, secret="set-by-hand", events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    assert deliveries.attempt_delivery(delivery.pk) is None
    delivery.refresh_from_db()
    assert delivery.status == "failed" and delivery.last_error.startswith("endpoint secret")
    assert receiver.received == []


def test_failure_then_success_records_every_attempt(sandbox: Any, receiver: Receiver) -> None:
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    receiver.statuses = [500]
    start = timezone.now()
    delay = deliveries.attempt_delivery(delivery.pk, start)
    assert delay is not None and 24 <= delay <= 36  # 30 s +-20 %
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status, delivery.last_error) == (1, 500, "HTTP 500")
    assert delivery.status == "pending" and delivery.next_attempt_at is not None
    assert deliveries.attempt_delivery(delivery.pk, start) is None  # not due yet: no early resend
    assert len(receiver.received) == 1
    assert deliveries.attempt_delivery(delivery.pk, delivery.next_attempt_at) is None
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and delivery.attempts == 2 and delivery.last_error == ""
    assert [a["status"] for a in delivery.attempt_log] == [500, 200]
    (first_headers, first), (second_headers, second) = receiver.received
    assert first == second  # the same event, the same id, on every retry
    assert first_headers["webhook-id"] == second_headers["webhook-id"]
    verified(endpoint.secret, second_headers, second)


@pytest.mark.usefixtures("loopback_allowed")
def test_unreachable_endpoint_backs_off_then_gives_up(sandbox: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    WebhookEndpoint.objects.create(url=f"http://127.0.0.1:{port}/", events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    delays = []
    for _ in range(deliveries.MAX_ATTEMPTS):
        delivery.refresh_from_db()
        delays.append(deliveries.attempt_delivery(delivery.pk, delivery.next_attempt_at))
    delivery.refresh_from_db()
    assert delivery.attempts == deliveries.MAX_ATTEMPTS and delivery.status == "failed"
    assert delays[-1] is None and all(d is not None for d in delays[:-1])
    assert all(b > a for a, b in itertools.pairwise([d or 0.0 for d in delays[:-1]]))  # growing
    assert 0.8 * 3810 <= sum(d or 0 for d in delays) <= 1.2 * 3810  # about an hour
    assert "refused" in delivery.last_error.lower() and delivery.last_status is None


@pytest.mark.usefixtures("on_commit_runs")  # placing, launching and stopping send on commit
def test_events_emitted_once_even_when_the_close_runs_twice(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    WebhookEndpoint.objects.create(url="http://127.0.0.1:9/", events=["usage.closed", "sandbox.stopped"])
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    now = timezone.now()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, now)
    actions.do_request_stop(sandbox.pk, people["owner"])
    for _ in range(2):  # a broker may deliver the stop report twice
        actions.do_mark_stopped(sandbox.allocation_key, now + timedelta(minutes=5))
    assert sorted(WebhookDelivery.objects.values_list("event", flat=True)) == [
        "sandbox.stopped",
        "usage.closed",
    ]
    stopped = WebhookDelivery.objects.get(event="sandbox.stopped")
    assert stopped.payload["sandbox_id"] == sandbox.pk and stopped.payload["state"] == "stopped"
    assert stopped.payload["from_state"] == "stopping"
    # Saving the closed record again (same fact) makes no delivery at all: nothing listens.
    UsageRecord.objects.get(sandbox=sandbox).save()
    assert WebhookDelivery.objects.filter(event="usage.closed").count() == 1


def test_a_sandbox_stopped_before_it_ran_is_an_event_too(sandbox: Any, people: Any) -> None:
    WebhookEndpoint.objects.create(url="http://a.invalid/", events=["sandbox.stopped"])
    actions.do_request_stop(sandbox.pk, people["owner"])  # still queued: ends at once
    [delivery] = WebhookDelivery.objects.all()
    assert delivery.payload["sandbox_id"] == sandbox.pk and delivery.payload["state"] == "stopped"


def test_no_post_save_receiver_carries_behaviour() -> None:
    """The webhooks are emitted from the actions and the ledger, which a reader sees; no
    portal code hangs on saving a usage record or a sandbox event."""
    for model in (UsageRecord, SandboxEvent):
        sync, async_ = post_save._live_receivers(model)
        modules = [getattr(r, "__module__", "") for r in [*sync, *async_]]
        assert not [m for m in modules if m.startswith(("portal", "workers"))], (model, modules)


def test_endpoints_get_only_their_events_and_projects(sandbox: Any, people: Any) -> None:
    everything = WebhookEndpoint.objects.create(url="http://a.invalid/", events=["usage.closed"])
    mine = WebhookEndpoint.objects.create(
        url="http://b.invalid/", events=["usage.closed"], project=people["project"]
    )
    theirs = WebhookEndpoint.objects.create(
        url="http://c.invalid/", events=["usage.closed"], project=people["other_project"]
    )
    other_event = WebhookEndpoint.objects.create(url="http://d.invalid/", events=["invoice.finalized"])
    WebhookEndpoint.objects.create(url="http://e.invalid/", events=["usage.closed"], active=False)
    open_usage(sandbox)
    close()
    got = set(WebhookDelivery.objects.values_list("endpoint_id", flat=True))
    assert got == {everything.pk, mine.pk}
    assert theirs.pk not in got and other_event.pk not in got


def test_admin_lists_deliveries_and_redelivers(
    sandbox: Any, people: Any, receiver: Receiver, sent_tasks: Any, django_capture_on_commit_callbacks: Any
) -> None:
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    deliveries.attempt_delivery(delivery.pk)
    admin = client_for(people["admin"])
    changelist = reverse("admin:webhooks_webhookdelivery_changelist")
    assert admin.get(changelist, {"status": "delivered", "event": "usage.closed"}).status_code == 200
    page = admin.get(reverse("admin:webhooks_webhookendpoint_change", args=[endpoint.pk]))
    assert page.status_code == 200 and str(delivery.event_id) in page.content.decode()
    sent_tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        response = admin.post(changelist, {"action": "redeliver", "_selected_action": [delivery.pk]})
    assert response.status_code == 302
    assert sent_tasks == [("control", "deliver_webhook", (delivery.pk,))]
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.attempts == 0 and len(delivery.attempt_log) == 1
    assert deliveries.attempt_delivery(delivery.pk) is None
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and len(receiver.received) == 2
    (_, first), (second_headers, second) = receiver.received
    assert json.loads(first)["id"] == json.loads(second)["id"] == second_headers["webhook-id"]  # deduped on
    verified(endpoint.secret, second_headers, second)


def test_sweeper_requeues_overdue_deliveries(sandbox: Any, sent_tasks: Any) -> None:
    WebhookEndpoint.objects.create(url="http://a.invalid/", events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    sent_tasks.clear()
    assert deliveries.webhook_tick(timezone.now()) == 0  # just created: its message is on its way
    assert deliveries.webhook_tick(timezone.now() + timedelta(minutes=6)) == 1
    assert sent_tasks == [("control", "deliver_webhook", (delivery.pk,))]


def test_the_control_tasks_call_the_delivery(sandbox: Any, receiver: Receiver, sent_tasks: Any) -> None:
    from workers import control

    WebhookEndpoint.objects.create(url=receiver.url, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    receiver.statuses = [503]
    with pytest.raises(Exception) as retry:  # celery.exceptions.Retry, with the recorded backoff
        control.TASKS["deliver_webhook"].run(delivery.pk)
    assert type(retry.value).__name__ == "Retry"
    delivery.refresh_from_db()
    assert delivery.attempts == 1 and delivery.last_status == 503


def test_an_old_plain_secret_becomes_whsec_with_the_same_key(sandbox: Any, receiver: Receiver) -> None:
    """webhooks 0002 on an existing endpoint: its plain secret (the old HMAC key) becomes
    whsec_<base64 of it>, so its receiver verifies with the key it already has."""
    from django.apps import apps
    from django.db import connection

    migration = importlib.import_module("portal.webhooks.migrations.0002_secret_rotation_and_alert_events")
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, secret="old-secret", events=["usage.closed"])
    migration.secrets_to_whsec(apps, SimpleNamespace(connection=connection))
    endpoint.refresh_from_db()
    assert endpoint.secret == "whsec_" + base64.b64encode(b"old-secret").decode()
    open_usage(sandbox)
    close()
    deliveries.attempt_delivery(WebhookDelivery.objects.get().pk)
    [(headers, body)] = receiver.received
    assert Webhook(b"old-secret").verify(body, headers)["event"] == "usage.closed"
