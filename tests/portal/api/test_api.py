"""The REST API: token scopes, self-service sandboxes, idempotency, usage filters and CSV,
read endpoints and rate limits, each from the outsider's side too."""

from __future__ import annotations

import csv
import io
import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken, Membership
from portal.api.idempotency import delete_expired_keys
from portal.api.models import IdempotencyKey
from portal.billing.models import UsageRecord
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.api import SandboxSerializer
from portal.sandboxes.models import Sandbox
from tests.factories import MembershipFactory, UserFactory
from tests.portal.helpers import place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
ALL = list(ApiToken.Scope.values)
READ, WRITE, ADMIN = ApiToken.Scope.READ_USAGE, ApiToken.Scope.WRITE_SANDBOXES, ApiToken.Scope.ADMIN


@pytest.fixture(autouse=True)
def _fresh_rate_limits() -> None:
    cache.clear()  # rate-limit counters are per token; a fresh start for each test


@pytest.fixture
def world(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> dict[str, Any]:
    ran = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    ran.refresh_from_db()
    actions.do_mark_running(ran.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    theirs = request(people["outsider"], people["other_project"], catalog["mig"], catalog["image"],
                     mig_profile="1g.10gb")  # fmt: skip
    place_all()
    theirs.refresh_from_db()
    actions.do_mark_running(theirs.allocation_key, {"driver": "docker", "ref": "d"}, timezone.now())
    return {**people, **catalog, "ran": ran, "theirs": theirs}


def api(user: Any, scopes: list[str]) -> Client:
    _, key = ApiToken.issue(user, "test", scopes)
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def create_body(**fields: Any) -> dict[str, Any]:
    """A dedicated request; another tier's fields replace ``gpu_count`` (it would not apply)."""
    shape = {"gpu_count": 1} if fields.get("tier", "dedicated") == "dedicated" else {}
    return {"project": "vision", "tier": "dedicated", "image": "busybox", "isolation": "container",
            "duration_hours": 1, **shape, **fields}  # fmt: skip


def post(client: Client, path: str, body: dict[str, Any] | None = None, key: str | None = None) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(path, body or {}, content_type="application/json", headers=headers)


# --- scopes ---------------------------------------------------------------------------------


def test_a_read_token_reads_but_cannot_write(world: dict[str, Any]) -> None:
    client = api(world["owner"], [READ])
    for path in ("/api/v1/usage/", "/api/v1/sandboxes/", "/api/v1/prices/", "/api/v1/projects/",
                 "/api/v1/quotas/", "/api/v1/invoices/", "/api/v1/usage/export.csv"):  # fmt: skip
        assert client.get(path).status_code == 200, path
    response = post(client, "/api/v1/sandboxes/", create_body())
    assert response.status_code == 403
    assert "write:sandboxes" in response.json()["detail"]
    assert not Sandbox.objects.filter(owner=world["owner"]).exclude(pk=world["ran"].pk).exists()


def test_a_write_token_cannot_read_usage(world: dict[str, Any]) -> None:
    client = api(world["owner"], [WRITE])
    response = client.get("/api/v1/usage/")
    assert response.status_code == 403 and "read:usage" in response.json()["detail"]
    assert post(client, "/api/v1/sandboxes/", create_body()).status_code == 201


def test_staff_reach_every_project_only_with_the_admin_scope(world: dict[str, Any]) -> None:
    admin = world["admin"]
    narrow = api(admin, [READ, WRITE]).get("/api/v1/sandboxes/").json()["results"]
    assert narrow == []  # ada is in no project: without admin, a token has a member's reach
    wide = api(admin, [ADMIN]).get("/api/v1/sandboxes/").json()["results"]
    assert {s["id"] for s in wide} == {world["ran"].pk, world["theirs"].pk}
    assert api(admin, [READ]).post(f"/api/v1/sandboxes/{world['theirs'].pk}/stop/").status_code == 403
    assert api(admin, [WRITE]).post(f"/api/v1/sandboxes/{world['theirs'].pk}/stop/").status_code == 404


def test_a_session_needs_its_csrf_token(world: dict[str, Any]) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(world["owner"])
    assert client.get("/api/v1/usage/").status_code == 200
    response = post(client, "/api/v1/sandboxes/", create_body())
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]


def test_revoked_and_unknown_tokens_are_401(world: dict[str, Any]) -> None:
    token, key = ApiToken.issue(world["owner"], "t", ALL)
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    assert Client(HTTP_AUTHORIZATION=f"Bearer {key}").get("/api/v1/usage/").status_code == 401
    assert Client(HTTP_AUTHORIZATION="Bearer gps_nope").get("/api/v1/usage/").status_code == 401


# --- sandboxes ------------------------------------------------------------------------------


def test_create_returns_the_queued_sandbox(world: dict[str, Any]) -> None:
    response = post(api(world["member"], [WRITE, READ]), "/api/v1/sandboxes/", create_body(duration_hours=2))
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "queued" and body["owner"] == "mark" and body["tier"] == "dedicated"
    assert body["max_duration_hours"] == 2.0
    assert Sandbox.objects.get(pk=body["id"]).owner == world["member"]


def test_a_request_reads_each_row_once(world: dict[str, Any], django_assert_max_num_queries: Any) -> None:
    """A POST under a quota, as in a burst of them (BENCHMARKS.md, "A burst of requests"):
    the form does not read again the project, tier and image the API read by slug, the
    request's notice not the quota and live count its check read, the answer not the
    sandbox just made, and the token's last use is written once a minute. 23 queries before."""
    QuotaPolicy.objects.create(project=world["project"], max_live_sandboxes=100)
    client = api(world["member"], ALL)
    body = create_body(run="batch", command="true")
    assert post(client, "/api/v1/sandboxes/", body).status_code == 201
    # 15 (1 the member's own GPU limit), and a transaction's two savepoint statements
    with django_assert_max_num_queries(17):
        answer = post(client, "/api/v1/sandboxes/", body)
    assert answer.status_code == 201, answer.json()
    made = Sandbox.objects.select_related("project", "owner", "tier", "image").get(pk=answer.json()["id"])
    as_read = SandboxSerializer(made).data
    assert answer.json() == json.loads(json.dumps(as_read, cls=DjangoJSONEncoder))  # the same answer


def test_batch_runs_carry_their_command(world: dict[str, Any]) -> None:
    body = create_body(run="batch", command="python train.py --epochs '3'")
    response = post(api(world["member"], ALL), "/api/v1/sandboxes/", body)
    assert response.status_code == 201
    assert response.json()["command"] == ["python", "train.py", "--epochs", "3"]
    missing = post(api(world["member"], ALL), "/api/v1/sandboxes/", create_body(run="batch"))
    assert missing.status_code == 400 and "command" in missing.json()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tier": "nope"}, "tier"),
        ({"image": "nope"}, "image"),
        ({"project": "nlp"}, "project"),  # not a member there
        ({"isolation": "vm"}, "isolation"),  # the tier allows container and process
        ({"isolation": "teleport"}, "isolation"),
        ({"duration_hours": 9}, "duration_hours"),  # the tier allows 8 h
        ({"gpu_count": 5}, "gpu_count"),  # the tier allows 4
        ({"gpu_count": "two"}, "gpu_count"),
        ({"tier": "mps", "mps_thread_pct": 0, "mps_memory_gib": 10}, "mps_thread_pct"),
        ({"tier": "mig", "mig_profile": "9g.1tb"}, "mig_profile"),
        # Finding 6 of the outside probe: fields that do not apply, and strings for numbers,
        # were taken (201) and ignored or converted.
        ({"tier": "timeslice", "mps_memory_gib": 10}, "mps_memory_gib"),
        ({"tier": "timeslice", "mig_profile": "1g.10gb"}, "mig_profile"),
        ({"tier": "mig", "mig_profile": "1g.10gb", "gpu_count": 1}, "gpu_count"),
        ({"gpu_count": "1"}, "gpu_count"),
        ({"duration_hours": 1.0}, "duration_hours"),
        ({"duration_hours": True}, "duration_hours"),
    ],
)
def test_bad_requests_name_the_field(world: dict[str, Any], fields: dict[str, Any], field: str) -> None:
    response = post(api(world["member"], ALL), "/api/v1/sandboxes/", create_body(**fields))
    assert response.status_code == 400
    assert field in response.json(), response.json()
    assert isinstance(response.json()[field], list) and response.json()[field][0]


def test_a_billing_viewer_cannot_request(world: dict[str, Any]) -> None:
    billing = UserFactory(username="bill")
    MembershipFactory(user=billing, project=world["project"], role=Membership.Role.BILLING)
    response = post(api(billing, ALL), "/api/v1/sandboxes/", create_body())
    assert response.status_code == 400 and "project" in response.json()


def test_quota_refusals_name_the_project(world: dict[str, Any]) -> None:
    QuotaPolicy.objects.create(project=world["project"], max_live_sandboxes=1)
    response = post(api(world["member"], ALL), "/api/v1/sandboxes/", create_body())
    assert response.status_code == 400 and "quota" in response.json()["project"][0]


def test_stop_and_extend(world: dict[str, Any]) -> None:
    client = api(world["member"], ALL)
    created = post(client, "/api/v1/sandboxes/", create_body()).json()
    extended = post(client, f"/api/v1/sandboxes/{created['id']}/extend/", {"hours": 2})
    assert extended.status_code == 200 and extended.json()["max_duration_hours"] == 3.0
    too_much = post(client, f"/api/v1/sandboxes/{created['id']}/extend/", {"hours": 8})
    assert too_much.status_code == 400 and "hours" in too_much.json()
    odd = post(client, f"/api/v1/sandboxes/{created['id']}/extend/", {"hours": 3})
    assert odd.status_code == 400 and "hours" in odd.json()
    for text in ("1", "²", 1.0):  # a string or a float for a number is refused, not converted
        typed = post(client, f"/api/v1/sandboxes/{created['id']}/extend/", {"hours": text})
        assert typed.status_code == 400 and "hours" in typed.json(), (text, typed.json())
    stopped = post(client, f"/api/v1/sandboxes/{created['id']}/stop/")
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped"


def test_only_the_owner_managers_and_admins_change_a_sandbox(world: dict[str, Any]) -> None:
    ran = world["ran"].pk  # olivia's
    assert post(api(world["outsider"], ALL), f"/api/v1/sandboxes/{ran}/stop/").status_code == 404
    assert post(api(world["member"], ALL), f"/api/v1/sandboxes/{ran}/stop/").status_code == 403
    assert (
        post(api(world["outsider"], ALL), f"/api/v1/sandboxes/{ran}/extend/", {"hours": 1}).status_code == 404
    )
    assert post(api(world["owner"], ALL), f"/api/v1/sandboxes/{ran}/stop/").status_code == 200
    assert Sandbox.objects.get(pk=ran).state == "stopping"


def test_outsiders_see_nothing_of_a_project(world: dict[str, Any]) -> None:
    client = api(world["outsider"], ALL)
    assert client.get(f"/api/v1/sandboxes/{world['ran'].pk}/").status_code == 404
    usage = UsageRecord.objects.get(sandbox=world["ran"])
    assert client.get(f"/api/v1/usage/{usage.pk}/").status_code == 404
    assert [u["project"] for u in client.get("/api/v1/usage/").json()["results"]] == ["nlp"]
    assert [p["slug"] for p in client.get("/api/v1/projects/").json()["results"]] == ["nlp"]


# --- idempotency ----------------------------------------------------------------------------


def test_the_same_key_twice_creates_one_sandbox(world: dict[str, Any]) -> None:
    client = api(world["member"], ALL)
    first = post(client, "/api/v1/sandboxes/", create_body(), key="k-1")
    again = post(client, "/api/v1/sandboxes/", create_body(), key="k-1")
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert Sandbox.objects.filter(owner=world["member"]).count() == 1
    other = post(client, "/api/v1/sandboxes/", create_body(duration_hours=2), key="k-1")
    assert other.status_code == 422 and "k-1" in other.json()["detail"]
    stop = post(client, f"/api/v1/sandboxes/{first.json()['id']}/stop/", key="k-1")
    assert stop.status_code == 422  # another path: a key names one request
    # Keys are per user: mark's key does not answer olivia.
    assert post(api(world["owner"], ALL), "/api/v1/sandboxes/", create_body(), key="k-1").status_code == 201


def test_errors_are_not_stored_so_a_fixed_retry_may_reuse_the_key(world: dict[str, Any]) -> None:
    client = api(world["member"], ALL)
    assert post(client, "/api/v1/sandboxes/", create_body(tier="nope"), key="k-2").status_code == 400
    assert post(client, "/api/v1/sandboxes/", create_body(), key="k-2").status_code == 201
    assert post(client, "/api/v1/sandboxes/", create_body(), key="x" * 256).status_code == 400


@pytest.mark.races
@pytest.mark.django_db(transaction=True)  # two threads, two connections
def test_two_concurrent_posts_with_one_key_create_one_sandbox(world: dict[str, Any]) -> None:
    _, key = ApiToken.issue(world["member"], "race", ALL)
    barrier = threading.Barrier(2)
    answers: list[Any] = []

    def send() -> None:
        try:
            barrier.wait(timeout=10)
            client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
            answers.append(post(client, "/api/v1/sandboxes/", create_body(), key="race-1"))
        finally:
            connection.close()  # each thread has its own connection

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert sorted(a.get("Idempotent-Replayed", "") for a in answers) == ["", "true"]
    assert Sandbox.objects.filter(owner=world["member"]).count() == 1


def test_keys_expire_after_a_day(world: dict[str, Any]) -> None:
    client = api(world["member"], ALL)
    post(client, "/api/v1/sandboxes/", create_body(), key="old")
    IdempotencyKey.objects.update(created_at=timezone.now() - timedelta(hours=25))
    assert delete_expired_keys() == 1
    assert post(client, "/api/v1/sandboxes/", create_body(), key="old").get("Idempotent-Replayed") is None


# --- usage: filters, pages, CSV -------------------------------------------------------------


def test_usage_filters(world: dict[str, Any]) -> None:
    client = api(world["admin"], [ADMIN])
    assert len(client.get("/api/v1/usage/").json()["results"]) == 2

    def ids(query: str) -> list[str]:
        response = client.get(f"/api/v1/usage/?{query}")
        assert response.status_code == 200, response.json()
        return [u["project"] for u in response.json()["results"]]

    assert ids("project=vision") == ["vision"]
    assert ids("user=oscar") == ["nlp"]
    assert ids("tier=mig") == ["nlp"]
    assert ids("tier=dedicated&user=oscar") == []
    now = timezone.now()
    assert len(ids(f"start={(now - timedelta(hours=1)).isoformat().replace('+00:00', 'Z')}")) == 2
    assert ids(f"end={(now - timedelta(hours=1)).date().isoformat()}") == []
    bad = client.get("/api/v1/usage/?start=yesterday")
    assert bad.status_code == 400 and "start" in bad.json()
    backwards = client.get("/api/v1/usage/?start=2026-02-01&end=2026-01-01")
    assert backwards.status_code == 400 and "end" in backwards.json()


def test_usage_pages_by_cursor_in_constant_queries(
    world: dict[str, Any], django_assert_max_num_queries: Any
) -> None:
    client = api(world["admin"], [ADMIN])
    with django_assert_max_num_queries(8):  # auth, token touch, page; not one per row
        first = client.get("/api/v1/usage/?page_size=1").json()
    assert len(first["results"]) == 1 and first["next"]
    second = client.get(first["next"]).json()
    assert len(second["results"]) == 1 and second["results"][0]["id"] != first["results"][0]["id"]
    assert client.get("/api/v1/usage/?cursor=garbage").status_code == 404


def test_usage_csv(world: dict[str, Any]) -> None:
    UsageRecord.objects.filter(sandbox=world["ran"]).update(
        ended_at=timezone.now(), duration=timedelta(hours=1), cost_micros=2_500_000
    )
    response = api(world["owner"], [READ]).get("/api/v1/usage/export.csv?project=vision")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    content = b"".join(response.streaming_content)  # type: ignore[attr-defined]
    rows = list(csv.DictReader(io.StringIO(content.decode())))
    assert len(rows) == 1
    row = rows[0]
    assert row["project"] == "vision" and row["user"] == "olivia" and row["currency"] == "EUR"
    assert row["cost_micros"] == "2500000" and row["duration_seconds"] == "3600.000"
    assert row["price_per_gpu_hour_micros"] == "2500000"
    bad = api(world["owner"], [READ]).get("/api/v1/usage/export.csv?end=nope")
    assert bad.status_code == 400 and "end" in bad.json()
    as_csv = api(world["owner"], [READ]).get("/api/v1/usage/export.csv?end=nope", HTTP_ACCEPT="text/csv")
    assert as_csv.status_code == 400 and as_csv.content.decode().startswith("field,message\r\nend,")


# --- read endpoints -------------------------------------------------------------------------


def test_prices_projects_and_quotas(world: dict[str, Any]) -> None:
    QuotaPolicy.objects.create(project=world["project"], max_live_sandboxes=4)
    QuotaPolicy.objects.create(project=world["other_project"])
    client = api(world["owner"], [READ])
    prices = {p["slug"]: p for p in client.get("/api/v1/prices/").json()["results"]}
    assert prices["mig"]["price_per_gpu_hour_micros"] == 700_000
    assert prices["mig"]["mode"] == "mig" and prices["mig"]["currency"] == "EUR"
    projects = client.get("/api/v1/projects/").json()["results"]
    assert projects == [
        {"slug": "vision", "name": "Vision", "role": "manager", "created_at": projects[0]["created_at"]}
    ]
    quotas = client.get("/api/v1/quotas/").json()["results"]
    assert [(q["project"], q["max_live_sandboxes"]) for q in quotas] == [("vision", 4)]


def test_invoice_filters_are_checked(world: dict[str, Any]) -> None:
    client = api(world["owner"], [READ])
    assert client.get("/api/v1/invoices/?period=2026-11&state=draft&project=vision").status_code == 200
    assert "period" in client.get("/api/v1/invoices/?period=2026-13").json()
    assert "state" in client.get("/api/v1/invoices/?state=paid").json()


# --- rate limits ----------------------------------------------------------------------------


def test_bursts_get_429_with_retry_after(world: dict[str, Any], settings: Any) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "3/min", "sustained": "100/hour"},
    }
    client = api(world["owner"], [READ])
    assert [client.get("/api/v1/prices/").status_code for _ in range(3)] == [200, 200, 200]
    limited = client.get("/api/v1/prices/")
    assert limited.status_code == 429 and int(limited["Retry-After"]) > 0
    # Per token: another token of the same user has its own budget.
    assert api(world["owner"], [READ]).get("/api/v1/prices/").status_code == 200


def test_invoices_of_visible_projects_with_lines_and_credit_notes(world: dict[str, Any]) -> None:
    from portal.billing.models import Invoice, InvoiceLine

    record = UsageRecord.objects.get(sandbox=world["ran"])
    now = timezone.now()
    invoice = Invoice.objects.create(
        project=world["project"], period_start=now.date().replace(day=1), currency="EUR", total_micros=5
    )
    InvoiceLine.objects.create(
        invoice=invoice, usage_record=record, sandbox_id=world["ran"].pk, tier=world["dedicated"],
        gpu_model="H100", milli_gpu=1000, price_per_gpu_hour_micros=2_500_000, started_at=now,
        ended_at=now, seconds=0, cost_micros=5,
    )  # fmt: skip
    client = api(world["owner"], [READ])
    listed = client.get(f"/api/v1/invoices/?project=vision&state=draft&period={now:%Y-%m}").json()["results"]
    assert [i["id"] for i in listed] == [invoice.pk]
    detail = client.get(f"/api/v1/invoices/{invoice.pk}/").json()
    assert detail["lines"][0]["cost_micros"] == 5 and detail["credit_notes"] == []
    assert api(world["outsider"], [READ]).get(f"/api/v1/invoices/{invoice.pk}/").status_code == 404
    assert api(world["outsider"], [READ]).get("/api/v1/invoices/").json()["results"] == []
