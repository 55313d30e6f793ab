"""Sandboxes' apps on origins of their own: the portal's grant, the app session it buys on the
app's origin, what ends that session, and the Host rule that keeps the portal and the apps
apart (portal/tunnels/app_origin.py, app_access.py, portal/asgi.py). The relay itself:
test_app_proxy.py; in Chromium: tests/browser/test_app_origin_browser.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.test import override_settings

from portal.asgi import application
from portal.sandboxes.models import Sandbox
from portal.tunnels import app_access
from portal.tunnels.app_origin import GRANT_PATH, AppLabel, AppsDomain, AppsDomainError
from tests.portal.helpers import client_for
from tests.portal.tunnels.test_app_proxy import APPS, app_host, app_session_for, with_app
from tests.portal.tunnels.test_terminal import WAIT_S, running_sandbox

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _apps_on_their_own_origins() -> Iterator[None]:
    with override_settings(APPS=APPS, PORTAL_URL="http://gpus.test"):
        yield


def on_app_host(
    host: bytes, path: str, cookie: str = "", extra: list[tuple[bytes, bytes]] | None = None
) -> Any:
    headers = [(b"host", host), *([(b"cookie", cookie.encode())] if cookie else []), *(extra or [])]
    comm = HttpCommunicator(application, "GET", path.split("?")[0], headers=headers)
    comm.scope["query_string"] = path.partition("?")[2].encode()
    return asyncio.run(comm.get_response(timeout=WAIT_S))


def header(answer: dict[str, Any], name: bytes) -> str:
    return next((v.decode() for k, v in answer["headers"] if k.lower() == name), "")


def grant_code(user: Any, session: str, target: app_access.Target, sandbox: Sandbox) -> str:
    url = app_access.issue_grant(user, session, target, sandbox.pk, "/")
    return parse_qs(urlsplit(url).query)["code"][0]


def label_of(sandbox: Sandbox) -> AppLabel:
    return AppLabel(sandbox.pk, sandbox.allocation_key)


@pytest.mark.django_db(transaction=True)
def test_the_portal_grants_the_owner_once_and_the_apps_origin_keeps_its_cookie_to_itself(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    opened = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/app/lab?reset=1")
    assert opened.status_code == 302 and opened["Cache-Control"] == "no-store"
    grant = urlsplit(opened["Location"])
    assert f"{grant.scheme}://{grant.netloc}" == APPS.origin(sandbox.pk, sandbox.allocation_key)  # type: ignore[union-attr]
    assert grant.path == GRANT_PATH and parse_qs(grant.query)["next"] == ["/lab?reset=1"]

    redeemed = on_app_host(app_host(sandbox), f"{grant.path}?{grant.query}")
    assert redeemed["status"] == 303 and header(redeemed, b"location") == "/lab?reset=1"
    cookie = header(redeemed, b"set-cookie")
    assert cookie.startswith("gpushare_app=")
    attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert attributes == {"path", "httponly", "samesite", "max-age"}  # no Domain: this host only
    assert "SameSite=Lax" in cookie and header(redeemed, b"referrer-policy") == "no-referrer"

    again = on_app_host(app_host(sandbox), f"{grant.path}?{grant.query}")
    assert again["status"] == 403 and b"used or has expired" in again["body"]


@pytest.mark.django_db
def test_a_grant_opens_only_the_origin_it_was_made_for(people: Any, catalog: Any, fleet: Any) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    session = client_for(people["owner"]).session.session_key or ""
    target = app_access.Target("h", sandbox.allocation_key, None)
    code = parse_qs(
        urlsplit(app_access.issue_grant(people["owner"], session, target, sandbox.pk, "/")).query
    )["code"]
    assert app_access.redeem_grant(code[0], AppLabel(sandbox.pk + 1, sandbox.allocation_key)) is None
    # Spent by that attempt: a grant is tried once, wherever.
    assert app_access.redeem_grant(code[0], label_of(sandbox)) is None
    assert app_access.redeem_grant("made-up", label_of(sandbox)) is None


@pytest.mark.django_db
def test_the_next_path_stays_on_the_apps_origin() -> None:
    assert app_access.safe_next("/lab/tree?x=1") == "/lab/tree?x=1"
    for path in (
        "//evil.example/",
        "/\\evil.example",
        "https://evil.example/",
        "lab",
        "/a\r\nSet-Cookie: x",
    ):
        assert app_access.safe_next(path) == "/"


@pytest.mark.django_db(transaction=True)
def test_without_an_app_session_a_page_load_goes_round_the_portal_and_a_script_is_refused(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    page = on_app_host(app_host(sandbox), "/lab?reset=1", extra=[(b"sec-fetch-mode", b"navigate")])
    assert page["status"] == 302
    assert header(page, b"location") == f"http://gpus.test/sandboxes/{sandbox.pk}/app/lab?reset=1"
    script = on_app_host(app_host(sandbox), "/api/contents", extra=[(b"sec-fetch-mode", b"cors")])
    assert script["status"] == 403 and b"No app session here" in script["body"]
    assert not [t for t in sent_tasks if t[1] == "open_app"]


@pytest.mark.django_db
@pytest.mark.parametrize("ending", ["signed out", "password changed", "deactivated", "another sandbox's"])
def test_what_ends_an_app_session(people: Any, catalog: Any, fleet: Any, ending: str) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    owner = people["owner"]
    browser = client_for(owner)
    session = browser.session.session_key or ""
    target = app_access.Target("h", sandbox.allocation_key, None)
    code = parse_qs(urlsplit(app_access.issue_grant(owner, session, target, sandbox.pk, "/")).query)["code"][
        0
    ]
    value = app_access.redeem_grant(code, label_of(sandbox))
    assert value is not None and isinstance(app_access.admit(value, label_of(sandbox)), tuple)
    label = label_of(sandbox)
    if ending == "signed out":
        browser.post("/logout/")
    elif ending == "password changed":
        owner.set_password("another-horse-battery")
        owner.save()
    elif ending == "deactivated":
        owner.is_active = False
        owner.save()
    else:
        label = AppLabel(sandbox.pk + 100, sandbox.allocation_key)
    assert app_access.admit(value, label) is None


@pytest.mark.django_db
def test_an_earlier_runs_origin_is_gone_once_the_sandbox_runs_elsewhere(
    people: Any, catalog: Any, fleet: Any
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    value = app_session_for(people["owner"], sandbox)
    label = label_of(sandbox)
    Sandbox.objects.filter(pk=sandbox.pk).update(allocation_key="f" * 32)  # moved: a new placement
    verdict = app_access.admit(value, label)
    assert isinstance(verdict, app_access.Refusal) and verdict.status == 410


@pytest.mark.django_db(transaction=True)
def test_the_portal_never_answers_on_an_apps_host(people: Any, catalog: Any, fleet: Any) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    session = client_for(people["owner"]).cookies["sessionid"].value
    for host in (b"apps.gpus.test", b"nosuch.apps.gpus.test", b"1-x.apps.gpus.test:8000"):
        answer = on_app_host(host, "/login/", cookie=f"sessionid={session}")
        assert answer["status"] == 404 and b"No sandbox's app is served" in answer["body"]
    # A portal path on a real app host is the app's (here: no app session, round the portal).
    answer = on_app_host(app_host(sandbox), "/admin/", cookie=f"sessionid={session}")
    assert answer["status"] == 302 and "/app/admin/" in header(answer, b"location")
    # The portal's sockets neither: the fleet's live figures are not served there.
    fleet_socket = WebsocketCommunicator(
        application,
        "/ws/fleet/",
        headers=[
            (b"host", app_host(sandbox)),
            (b"origin", b"http://" + app_host(sandbox)),
            (b"cookie", f"sessionid={session}".encode()),
        ],
    )
    assert asyncio.run(fleet_socket.connect(timeout=WAIT_S)) == (False, 4403)


def test_apps_domain_is_parsed_and_must_stand_apart_from_the_portal() -> None:
    apps = AppsDomain.parse("Apps.GPUs.example.org.", "https://gpus.example.org")
    assert apps is not None and apps.origin(7, "a" * 32) == f"https://7-{'a' * 32}.apps.gpus.example.org"
    local = AppsDomain.parse("apps.localhost", "http://localhost:8000")
    assert local is not None and local.origin(7, "a" * 32) == f"http://7-{'a' * 32}.apps.localhost:8000"
    assert local.label(f"7-{'a' * 32}.apps.localhost:8000") == AppLabel(7, "a" * 32)
    assert local.label(f"7-{'a' * 32}.apps.localhost.evil.test") is None
    assert AppsDomain.parse("", "http://x") is None
    for bad, says in (
        ("apps..example.org", "is not a domain name"),
        ("apps.example.org:99999", "is not a port"),
        ("example.org", "would hold the portal's own host"),
        ("gpus.example.org", "would hold the portal's own host"),
    ):
        with pytest.raises(AppsDomainError, match=says):
            AppsDomain.parse(bad, "https://gpus.example.org")
    assert apps.overlaps(["gpus.example.org"], ["https://gpus.example.org"]) == ""
    assert "ALLOWED_HOSTS" in apps.overlaps([".example.org"], [])
    assert "ALLOWED_HOSTS" in apps.overlaps(["*"], [])
    assert "CSRF_TRUSTED_ORIGINS" in apps.overlaps(["gpus.example.org"], ["https://*.example.org"])


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"APPS_DOMAIN": "apps.gpus.test", "ALLOWED_HOSTS": ".gpus.test"},
            "ALLOWED_HOSTS (.gpus.test) matches",
        ),
        ({"APPS_DOMAIN": "not a domain"}, "is not a domain name"),
    ],
)
def test_a_portal_that_would_answer_on_its_apps_origins_does_not_start(
    env: dict[str, str], says: str
) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "PORTAL_URL": "https://gpus.test", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and says in result.stderr, result.stderr


def test_over_https_the_portals_cookies_cannot_be_planted_from_a_sibling_origin() -> None:
    """``__Host-`` names: a browser refuses such a cookie set with a Domain, as an app's
    document.cookie on apps.gpus.test would set one for the whole site."""
    names = "SESSION_COOKIE_NAME", "CSRF_COOKIE_NAME", "DEVICE_COOKIE_NAME"
    script = f"from django.conf import settings as s; print({', '.join(f's.{n}' for n in names)})"
    env = {**os.environ, "SESSION_COOKIE_SECURE": "true", "CSRF_COOKIE_SECURE": "true"}
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-v", "0", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.split() == ["__Host-sessionid", "__Host-csrftoken", "__Host-gpushare_device"], (
        result.stderr
    )
