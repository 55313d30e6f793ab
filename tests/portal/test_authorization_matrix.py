"""Every URL and API route, for every kind of caller, with the status each must get.

The sandbox belongs to ``member`` (mark) in project Vision; ``manager`` (olivia) manages
Vision; ``billing`` (bill) is Vision's billing viewer; ``outsider`` (oscar) manages another
project; ``admin`` (ada) is staff. A redirect is written with where it goes: ``login``
(the sign-in page) or ``admin-login`` (Django admin's, for the console). A route added to
``portal/urls.py`` without a row here fails ``test_every_route_is_in_the_matrix``.
"""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from portal.accounts.models import ApiToken, Membership
from portal.accounts.ssh_keys import do_add_key
from portal.billing.models import Invoice, UsageRecord
from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.factories import MembershipFactory, UserFactory
from tests.portal.accounts.test_ssh_keys import ED25519
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

PERSONAS = ("anonymous", "outsider", "member", "manager", "billing", "admin")
LOGIN, ADMIN_LOGIN = "login", "admin-login"

# (method, path, {persona: expected}); {sandbox} and {gpu} are filled in. An expected value
# is a status code, or (302, LOGIN | ADMIN_LOGIN | "elsewhere").
ROUTES: list[tuple[str, str, dict[str, Any]]] = []


def route(method: str, path: str, **expected: Any) -> None:
    every = expected.pop("all", None)
    table = {p: every for p in PERSONAS} if every is not None else {}
    table.update(expected)
    assert set(table) == set(PERSONAS), path
    ROUTES.append((method, path, table))


SIGNED_IN = ("outsider", "member", "manager", "billing", "admin")


def signed_in(status: Any, anonymous: Any = (302, LOGIN), **more: Any) -> dict[str, Any]:
    return {"anonymous": anonymous, **{p: status for p in SIGNED_IN}, **more}


def staff_only(status: Any, anonymous: Any = (302, ADMIN_LOGIN)) -> dict[str, Any]:
    return {
        "anonymous": anonymous,
        **{p: (302, ADMIN_LOGIN) for p in SIGNED_IN if p != "admin"},
        "admin": status,
    }


route("GET", "/", all=(302, "elsewhere"))
route("GET", "/login/", all=200)
# Single sign-on's pages: not there while no provider is configured, as here
# (tests/identity/test_oidc_sign_in.py signs in through a real one).
route("GET", "/oidc/authenticate/", all=404)
route("GET", "/oidc/callback/", all=404)
# Prometheus brings a bearer token (tests/portal/telemetry/test_metrics.py); people need staff.
route("GET", "/metrics", **signed_in(403, anonymous=401, admin=200))
route("GET", "/sandboxes/", **signed_in(200))
route("GET", "/sandboxes/new/", **signed_in(200))
route("POST", "/sandboxes/preview/", **signed_in(200))
route("GET", "/notifications/", **signed_in(200))
route("GET", "/projects/", **signed_in(200))
route("GET", "/projects/vision/", **signed_in(200, outsider=404))
route("GET", "/projects/vision/invoices/{invoice}/", **signed_in(200, outsider=404))
# Members are changed by the project's managers and admins only.
route(
    "POST",
    "/projects/vision/members/",
    **signed_in((302, "elsewhere"), outsider=404, member=403, billing=403),
)
route("POST", "/notifications/", **signed_in((302, "elsewhere")))
# Email choices: everyone signed in sets their own; the matrix's fields are not the page's (400).
route("GET", "/account/notifications/", **signed_in(200))
route("POST", "/account/notifications/", **signed_in(400))
# A sandbox outside your projects does not exist for you (404, no hint).
route("GET", "/sandboxes/{sandbox}/", **signed_in(200, outsider=404))
route("GET", "/sandboxes/{sandbox}/status/", **signed_in(200, outsider=404))
# Changing it: its owner, its project's managers, admins; a billing viewer may only look.
route("POST", "/sandboxes/{sandbox}/stop/", **signed_in((302, "elsewhere"), outsider=404, billing=403))
route("POST", "/sandboxes/{sandbox}/extend/", **signed_in((302, "elsewhere"), outsider=404, billing=403))
route("GET", "/console/fleet/", **staff_only(200))
route("GET", "/console/plans/", **staff_only(200))
route("GET", "/console/queue/", **staff_only(200))
route("GET", "/console/audit/", **staff_only(200))
route("GET", "/console/catalog/", **staff_only(200))
route("GET", "/console/catalog/tiers/new/", **staff_only(200))
route("POST", "/console/catalog/quotas/new/", **staff_only(400))  # an empty form: errors
route("GET", "/console/catalog/tiers/{tier}/", **staff_only(200))
route("POST", "/console/plans/mig/", **staff_only(400))  # an empty form: errors, nothing runs
route("POST", "/console/plans/consolidate/", **staff_only(400))  # nothing to consolidate
route("POST", "/console/gpus/{gpu}/mode/", **staff_only(400))  # an empty form: the mode is required
route("POST", "/console/gpus/{gpu}/drain/", **staff_only((302, "elsewhere")))
route("POST", "/console/gpus/{gpu}/undrain/", **staff_only((302, "elsewhere")))
route("GET", "/console/gpus/{gpu}/", **staff_only(200))
# Host enrolment: an empty form is refused; a host with no credential is said so, on the list.
route("GET", "/console/hosts/", **staff_only(200))
route("POST", "/console/hosts/issue/", **staff_only(400))
route("POST", "/console/hosts/nowhere/rotate/", **staff_only((302, "elsewhere")))
route("POST", "/console/hosts/nowhere/revoke/", **staff_only((302, "elsewhere")))
route("GET", "/console/heatmap/", **staff_only(200))
# Chart history and alerts grant what the matching WebSocket grants: a sandbox's members,
# a GPU's admins (or members while their sandbox holds it; {gpu} is a free one), the fleet's staff.
route("GET", "/telemetry/sandboxes/{sandbox}/history/", **signed_in(200, outsider=403))
route("GET", "/telemetry/gpus/{gpu}/history/", **signed_in(403, admin=200))
route("GET", "/telemetry/fleet/history/", **signed_in(403, admin=200))
route("GET", "/telemetry/alerts/", **signed_in(403, admin=200))
route("GET", "/admin/", **staff_only(200))
route("GET", "/api/v1/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/usage/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/usage/{usage}/", **signed_in(200, anonymous=401, outsider=404))
route("GET", "/api/v1/sandboxes/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/sandboxes/{sandbox}/", **signed_in(200, anonymous=401, outsider=404))
# The matrix posts a form without the request's fields: 400 naming them, once signed in.
route("POST", "/api/v1/sandboxes/", **signed_in(400, anonymous=401))
route("POST", "/api/v1/sandboxes/{sandbox}/stop/", **signed_in(200, anonymous=401, outsider=404, billing=403))
# The fresh sandbox already has its tier's 8 h: one hour more is refused (400), once allowed.
route(
    "POST", "/api/v1/sandboxes/{sandbox}/extend/", **signed_in(400, anonymous=401, outsider=404, billing=403)
)
route("GET", "/api/v1/usage/export.csv", **signed_in(200, anonymous=401))
route("GET", "/api/v1/utilization/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/prices/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/projects/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/quotas/", **signed_in(200, anonymous=401))
route("GET", "/api/v1/invoices/", **signed_in(200, anonymous=401))
# The world's draft invoice is Vision's: another project's member does not see it.
route("GET", "/api/v1/invoices/{invoice}/", **signed_in(200, anonymous=401, outsider=404))
route("GET", "/api/schema/", **signed_in(200, anonymous=200))
route("GET", "/api/docs/", **signed_in(200, anonymous=200))
# A batch's output: whoever may see the sandbox.
route("GET", "/sandboxes/{sandbox}/output.txt", **signed_in(200, outsider=404))
# Its app (none here: 404 for its owner), which only its owner may open, on the app's origin.
route("GET", "/sandboxes/{sandbox}/app/", **signed_in(403, outsider=404, member=404))
route("GET", "/sandboxes/{sandbox}/app/lab/tree", **signed_in(403, outsider=404, member=404))
route("GET", "/api/v1/sandboxes/{sandbox}/output/", **signed_in(200, anonymous=401, outsider=404))
# Its history likewise; a request's preview takes the create's fields (400 without them).
route("GET", "/api/v1/sandboxes/{sandbox}/events/", **signed_in(200, anonymous=401, outsider=404))
route("GET", "/api/v1/sandboxes/{sandbox}/attempts/", **signed_in(200, anonymous=401, outsider=404))
route("POST", "/api/v1/sandboxes/preview/", **signed_in(400, anonymous=401))
# Accounts: your own password and tokens; a token is revoked by its owner (member) or staff,
# and does not exist for anyone else. Resetting a password needs no sign-in.
route("GET", "/account/password/", **signed_in(200))
route("GET", "/account/password/done/", **signed_in(200))
route("GET", "/account/tokens/", **signed_in(200))
route(
    "POST",
    "/account/tokens/{token}/revoke/",
    **signed_in(404, member=(302, "elsewhere"), admin=(302, "elsewhere")),
)
# SSH keys: each user's own; another's key does not exist for them, staff included. The
# matrix's empty form or body is refused (400) naming the public key it lacks.
route("GET", "/account/ssh-keys/", **signed_in(200))
route("POST", "/account/ssh-keys/", **signed_in(400))
route("POST", "/account/ssh-keys/{ssh_key}/remove/", **signed_in(404, member=(302, "elsewhere")))
route("GET", "/api/v1/ssh-keys/", **signed_in(200, anonymous=401))
route("POST", "/api/v1/ssh-keys/", **signed_in(400, anonymous=401))
route("GET", "/api/v1/ssh-keys/{ssh_key}/", **signed_in(405, anonymous=401))  # DELETE only
route("GET", "/password-reset/", all=200)
route("GET", "/password-reset/sent/", all=200)
route("GET", "/password-reset/{reset}/", all=200)  # a link that is not valid: says so
route("GET", "/password-reset/done/", all=200)
route("POST", "/logout/", all=(302, LOGIN))  # last: it signs the caller out


@pytest.fixture
def world(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> dict[str, Any]:
    billing = UserFactory(username="bill")
    MembershipFactory(user=billing, project=people["project"], role=Membership.Role.BILLING)
    users = {
        "outsider": people["outsider"],
        "member": people["member"],
        "manager": people["owner"],
        "billing": billing,
        "admin": people["admin"],
    }
    ran = request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    ran.refresh_from_db()
    actions.do_mark_running(ran.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    usage = UsageRecord.objects.get(sandbox=ran)
    gpu = Gpu.objects.filter(sharing_mode="dedicated").exclude(allocations__active=True).first()
    assert gpu is not None
    invoice = Invoice.objects.create(
        project=people["project"], period_start=date(2026, 11, 1), currency="EUR"
    )
    token, _key = ApiToken.issue(people["member"], "matrix", [ApiToken.Scope.READ_USAGE])
    ssh_key = do_add_key(people["member"], "matrix", ED25519)
    return {
        "users": users, "people": people, "catalog": catalog, "usage": usage.pk, "gpu": gpu.uuid,
        "invoice": invoice.pk, "token": token.pk, "ssh_key": ssh_key.pk,
    }  # fmt: skip


def fresh_sandbox(world: dict[str, Any]) -> Sandbox:
    """A new queued sandbox of ``member``'s (live, so it can be stopped or extended)."""
    people, catalog = world["people"], world["catalog"]
    return request(people["member"], people["project"], catalog["dedicated"], catalog["image"])


def outcome(response: Any) -> Any:
    if response.status_code != 302:
        return response.status_code
    where = response["Location"]
    if where.startswith("/admin/login/"):
        return (302, ADMIN_LOGIN)
    if where.startswith("/login/"):
        return (302, LOGIN)
    return (302, "elsewhere")


@pytest.mark.parametrize("persona", PERSONAS)
def test_each_caller_gets_what_the_matrix_says(world: dict[str, Any], persona: str) -> None:
    client = Client() if persona == "anonymous" else client_for(world["users"][persona])
    wrong = []
    for method, template, table in ROUTES:
        sandbox = fresh_sandbox(world)  # mutating routes get a live sandbox every time
        path = template.format(
            sandbox=sandbox.pk,
            gpu=world["gpu"],
            usage=world["usage"],
            tier=world["catalog"]["dedicated"].pk,
            invoice=world["invoice"],
            token=world["token"],
            ssh_key=world["ssh_key"],
            reset="MQ/not-a-token",
        )
        data = {"reason": "matrix", "hours": "1"} if method == "POST" else None
        if data and path.startswith("/api/"):  # the API refuses fields a route does not take
            data = {"hours": "1"} if path.endswith("/extend/") else {}
        response = client.post(path, data or {}) if method == "POST" else client.get(path)
        got = outcome(response)
        if got != table[persona]:
            wrong.append(f"{method} {template}: {got}, expected {table[persona]}")
    assert not wrong, "\n".join(wrong)


def test_api_tokens_are_checked_like_sessions(world: dict[str, Any]) -> None:
    sandbox = fresh_sandbox(world)
    _, outsider_key = ApiToken.issue(world["users"]["outsider"], "t", [ApiToken.Scope.READ_USAGE])
    _, member_key = ApiToken.issue(world["users"]["member"], "t", [ApiToken.Scope.READ_USAGE])
    path = f"/api/v1/sandboxes/{sandbox.pk}/"
    assert Client().get(path, HTTP_AUTHORIZATION=f"Bearer {outsider_key}").status_code == 404
    assert Client().get(path, HTTP_AUTHORIZATION=f"Bearer {member_key}").status_code == 200
    assert Client().get(path, HTTP_AUTHORIZATION="Bearer gps_not-a-token").status_code == 401


def _paths(patterns: list[Any], prefix: str = "") -> list[str]:
    found = []
    for pattern in patterns:
        text = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            if text.startswith("admin/") or text == "admin/":
                found.append("admin/")
                continue
            found += _paths(pattern.url_patterns, text)
        elif isinstance(pattern, URLPattern):
            found.append(text)
    return found


def test_every_route_is_in_the_matrix() -> None:
    """Each route of portal/urls.py (API formats and the router's root aside) has a row."""
    covered = {
        template.strip("/")
        .replace("projects/vision", "projects/<slug:slug>")
        .replace("{sandbox}", "<int:pk>")
        .replace("{usage}", "<int:pk>")
        .replace("{invoice}", "<int:pk>")
        .replace("{token}", "<int:pk>")
        .replace("{ssh_key}", "<int:pk>")
        .replace("{reset}", "<uidb64>/<token>")
        .replace("app/lab/tree", "app/<path:path>")
        .replace("{gpu}", "<str:uuid>")
        .replace("hosts/nowhere", "hosts/<slug:host>")
        .replace("catalog/tiers/new", "catalog/<str:kind>/new")
        .replace("catalog/quotas/new", "catalog/<str:kind>/new")
        .replace("catalog/tiers/{tier}", "catalog/<str:kind>/<int:pk>")
        for _, template, _ in ROUTES
    }
    missing = []
    for raw in _paths(get_resolver().url_patterns):
        path = raw.replace("(?P<pk>[^/.]+)", "<int:pk>").replace("^", "").replace("$", "").strip("/")
        if "format" in path:
            continue  # DRF's .json/.api suffix variants of the rows above
        if path and path not in covered and path != "healthz":
            missing.append(path)
    assert not missing, f"routes without a row in the authorization matrix: {missing}"
