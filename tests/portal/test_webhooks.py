"""Billing webhooks: emitted once per fact, signed, retried with backoff, every attempt
recorded, visible and redeliverable in the admin."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from portal.billing import ledger, webhooks
from portal.billing.models import UsageRecord, WebhookDelivery, WebhookEndpoint
from portal.sandboxes import actions
from tests.portal.helpers import client_for, place_all, request

SECRET = "whsec-test"


class Receiver:
    """A local HTTP endpoint answering the queued statuses (then 200), keeping what it got."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((dict(self.headers), body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
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


def test_usage_closed_is_signed_and_delivered(
    sandbox: Any, receiver: Receiver, sent_tasks: Any, django_capture_on_commit_callbacks: Any
) -> None:
    WebhookEndpoint.objects.create(url=receiver.url, secret=SECRET, events=["usage.closed"])
    record = open_usage(sandbox)
    assert not WebhookDelivery.objects.exists()  # opening is not an event
    with django_capture_on_commit_callbacks(execute=True):
        close()
    [delivery] = WebhookDelivery.objects.all()
    assert ("control", "deliver_webhook", (delivery.pk,)) in sent_tasks  # enqueued after commit
    assert webhooks.attempt_delivery(delivery.pk) is None
    [(headers, body)] = receiver.received
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["X-Gpushare-Signature"], expected)
    document = json.loads(body)
    assert document["id"] == str(delivery.event_id) == headers["X-Gpushare-Delivery"]
    assert document["event"] == "usage.closed" == headers["X-Gpushare-Event"]
    record.refresh_from_db()
    assert document["data"]["usage_record_id"] == record.pk
    assert document["data"]["cost_micros"] == record.cost_micros == 2_500_000
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and delivery.attempts == 1 and delivery.last_status == 200
    assert webhooks.attempt_delivery(delivery.pk) is None and len(receiver.received) == 1  # not twice


def test_failure_then_success_records_every_attempt(sandbox: Any, receiver: Receiver) -> None:
    WebhookEndpoint.objects.create(url=receiver.url, secret=SECRET, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    receiver.statuses = [500]
    start = timezone.now()
    delay = webhooks.attempt_delivery(delivery.pk, start)
    assert delay is not None and 24 <= delay <= 36  # 30 s +-20 %
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status, delivery.last_error) == (1, 500, "HTTP 500")
    assert delivery.status == "pending" and delivery.next_attempt_at is not None
    assert webhooks.attempt_delivery(delivery.pk, start) is None  # not due yet: no early resend
    assert len(receiver.received) == 1
    assert webhooks.attempt_delivery(delivery.pk, delivery.next_attempt_at) is None
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and delivery.attempts == 2 and delivery.last_error == ""
    assert [a["status"] for a in delivery.attempt_log] == [500, 200]
    bodies = [body for _, body in receiver.received]
    assert bodies[0] == bodies[1]  # the same event, the same id, on every retry


def test_unreachable_endpoint_backs_off_then_gives_up(sandbox: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    WebhookEndpoint.objects.create(url=f"http://127.0.0.1:{port}/", secret=SECRET, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    delays = []
    for _ in range(webhooks.MAX_ATTEMPTS):
        delivery.refresh_from_db()
        delays.append(webhooks.attempt_delivery(delivery.pk, delivery.next_attempt_at))
    delivery.refresh_from_db()
    assert delivery.attempts == webhooks.MAX_ATTEMPTS and delivery.status == "failed"
    assert delays[-1] is None and all(d is not None for d in delays[:-1])
    assert all(b > a for a, b in itertools.pairwise([d or 0.0 for d in delays[:-1]]))  # growing
    assert 0.8 * 3810 <= sum(d or 0 for d in delays) <= 1.2 * 3810  # about an hour
    assert "refused" in delivery.last_error.lower() and delivery.last_status is None


@pytest.mark.django_db(transaction=True)  # placement commits, as in test_actions
def test_events_emitted_once_even_when_the_close_runs_twice(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    WebhookEndpoint.objects.create(
        url="http://127.0.0.1:9/", secret=SECRET, events=["usage.closed", "sandbox.stopped"]
    )
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
    # Saving the closed record again (same fact) makes no second delivery either.
    UsageRecord.objects.get(sandbox=sandbox).save()
    assert WebhookDelivery.objects.filter(event="usage.closed").count() == 1


def test_endpoints_get_only_their_events_and_projects(sandbox: Any, people: Any) -> None:
    everything = WebhookEndpoint.objects.create(url="http://a.invalid/", secret="a", events=["usage.closed"])
    mine = WebhookEndpoint.objects.create(
        url="http://b.invalid/", secret="b", events=["usage.closed"], project=people["project"]
    )
    theirs = WebhookEndpoint.objects.create(
        url="http://c.invalid/", secret="c", events=["usage.closed"], project=people["other_project"]
    )
    other_event = WebhookEndpoint.objects.create(
        url="http://d.invalid/", secret="d", events=["invoice.finalized"]
    )
    WebhookEndpoint.objects.create(url="http://e.invalid/", secret="e", events=["usage.closed"], active=False)
    open_usage(sandbox)
    close()
    got = set(WebhookDelivery.objects.values_list("endpoint_id", flat=True))
    assert got == {everything.pk, mine.pk}
    assert theirs.pk not in got and other_event.pk not in got


def test_admin_lists_deliveries_and_redelivers(
    sandbox: Any, people: Any, receiver: Receiver, sent_tasks: Any
) -> None:
    endpoint = WebhookEndpoint.objects.create(url=receiver.url, secret=SECRET, events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    webhooks.attempt_delivery(delivery.pk)
    admin = client_for(people["admin"])
    changelist = reverse("admin:billing_webhookdelivery_changelist")
    assert admin.get(changelist, {"status": "delivered", "event": "usage.closed"}).status_code == 200
    page = admin.get(reverse("admin:billing_webhookendpoint_change", args=[endpoint.pk]))
    assert page.status_code == 200 and str(delivery.event_id) in page.content.decode()
    response = admin.post(changelist, {"action": "redeliver", "_selected_action": [delivery.pk]})
    assert response.status_code == 302
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.attempts == 0 and len(delivery.attempt_log) == 1
    assert webhooks.attempt_delivery(delivery.pk) is None
    delivery.refresh_from_db()
    assert delivery.status == "delivered" and len(receiver.received) == 2
    first, second = (json.loads(body)["id"] for _, body in receiver.received)
    assert first == second  # the receiver dedupes on it


def test_sweeper_requeues_overdue_deliveries(sandbox: Any, sent_tasks: Any) -> None:
    WebhookEndpoint.objects.create(url="http://a.invalid/", secret="a", events=["usage.closed"])
    open_usage(sandbox)
    close()
    delivery = WebhookDelivery.objects.get()
    sent_tasks.clear()
    assert webhooks.webhook_tick(timezone.now()) == 0  # just created: its message is on its way
    assert webhooks.webhook_tick(timezone.now() + timedelta(minutes=6)) == 1
    assert sent_tasks == [("control", "deliver_webhook", (delivery.pk,))]
