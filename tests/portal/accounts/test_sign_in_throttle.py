"""Password guessing from the outsider's side: the guesser is throttled, the account's owner
is not locked out by anyone else, and no client picks its own address (finding 5 of the
outside probe: a new X-Forwarded-For per request walked past the per-address limits, and
a few wrong passwords from anywhere locked a known username out for 15 minutes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.testing import ApplicationCommunicator
from django.conf import settings as django_settings
from django.core.cache import cache
from django.test import Client, override_settings

from portal.accounts.models import ApiToken

PASSWORD = "correct horse battery staple"
ATTACKER, OWNER_HOME = "203.0.113.7", "198.51.100.9"


@pytest.fixture(autouse=True)
def fast_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _sign_in(username: str, password: str, address: str = ATTACKER, client: Client | None = None) -> Any:
    client = client or Client(REMOTE_ADDR=address)
    return client.post("/login/", {"username": username, "password": password}, REMOTE_ADDR=address)


@pytest.fixture
def guesser(people: Any) -> Any:
    cache.clear()  # failure counters of earlier tests
    people["outsider"].set_password(PASSWORD)
    people["outsider"].save()
    limits = {"LOGIN_FAILURE_LIMIT": 3, "LOGIN_IP_FAILURE_LIMIT": 5, "LOGIN_USERNAME_FAILURE_LIMIT": 4}
    with override_settings(**limits, LOGIN_LOCKOUT_SECONDS=600):
        yield people["outsider"]
    cache.clear()


def test_repeated_failures_lock_the_guessing_address_out_of_that_account(guesser: Any) -> None:
    for _ in range(3):
        wrong = _sign_in("oscar", "guess")
        assert wrong.status_code == 200 and "enter a correct username and password" in wrong.content.decode()
    locked = _sign_in("oscar", PASSWORD)  # the right password no longer helps from there
    assert locked.status_code == 429 and locked["Retry-After"] == "600"
    assert "Too many failed sign-in attempts. Wait 10 minutes" in locked.content.decode()
    assert "sessionid" not in locked.cookies


def test_an_outsider_cannot_lock_the_owner_out(guesser: Any) -> None:
    """Three wrong passwords for oscar from the attacker's address: oscar, elsewhere, signs in."""
    for _ in range(3):
        _sign_in("OSCAR", "guess")
    assert _sign_in("oscar", PASSWORD, address=OWNER_HOME).status_code == 302


def test_a_browser_that_signed_in_before_keeps_signing_in_whatever_others_try(guesser: Any) -> None:
    owner = Client(REMOTE_ADDR=ATTACKER)  # even behind the attacker's own address (a shared NAT)
    first = _sign_in("oscar", PASSWORD, client=owner)
    assert first.status_code == 302 and django_settings.DEVICE_COOKIE_NAME in first.cookies
    owner.post("/logout/")
    for n in range(4):  # from many addresses: the account's name is being guessed
        _sign_in("oscar", "guess", address=f"192.0.2.{n}")
    for _ in range(3):
        _sign_in("oscar", "guess")  # and from the owner's own address
    assert _sign_in("oscar", PASSWORD, address="192.0.2.200").status_code == 429  # a new browser waits
    assert _sign_in("oscar", PASSWORD, client=owner).status_code == 302  # the owner's does not


def test_a_device_cookie_counts_its_own_failures_only(guesser: Any) -> None:
    owner = Client(REMOTE_ADDR=OWNER_HOME)
    assert _sign_in("oscar", PASSWORD, client=owner, address=OWNER_HOME).status_code == 302
    owner.post("/logout/")
    for _ in range(3):
        _sign_in("oscar", "typo", client=owner, address=OWNER_HOME)
    assert _sign_in("oscar", PASSWORD, client=owner, address=OWNER_HOME).status_code == 429
    assert _sign_in("oscar", PASSWORD, address="192.0.2.77").status_code == 302  # nobody else is locked


def test_a_forged_device_cookie_is_no_cookie(guesser: Any) -> None:
    for _ in range(3):
        _sign_in("oscar", "guess")
    forged = Client(REMOTE_ADDR=ATTACKER)
    forged.cookies[django_settings.DEVICE_COOKIE_NAME] = "oscar"
    assert _sign_in("oscar", PASSWORD, client=forged).status_code == 429


def test_a_successful_login_resets_its_pair_count(guesser: Any, settings: Any) -> None:
    settings.LOGIN_USERNAME_FAILURE_LIMIT = 100  # only the pair's count is at stake here
    for _ in range(2):
        _sign_in("oscar", "guess", address=OWNER_HOME)
    assert _sign_in("oscar", PASSWORD, address=OWNER_HOME).status_code == 302
    for _ in range(2):
        assert _sign_in("oscar", "guess", address=OWNER_HOME).status_code == 200
    assert _sign_in("oscar", PASSWORD, address=OWNER_HOME).status_code == 302


def test_login_locks_an_address_guessing_many_usernames(guesser: Any) -> None:
    for n in range(5):
        _sign_in(f"user{n}", "guess")
    assert _sign_in("oscar", PASSWORD).status_code == 429
    # A forged X-Forwarded-For does not escape: no header is read for the address.
    forged = Client(REMOTE_ADDR=ATTACKER).post(
        "/login/", {"username": "oscar", "password": PASSWORD}, headers={"X-Forwarded-For": "192.0.2.1"}
    )
    assert forged.status_code == 429
    assert _sign_in("oscar", PASSWORD, address=OWNER_HOME).status_code == 302


def test_the_admin_login_is_throttled_too(guesser: Any) -> None:
    client = Client(REMOTE_ADDR="203.0.113.8")
    for _ in range(3):
        client.post("/admin/login/", {"username": "ada", "password": "guess"})
    locked = client.post("/admin/login/", {"username": "ada", "password": "guess"})
    assert "Too many failed sign-in attempts" in locked.content.decode()


def test_a_right_password_at_the_admin_login_is_no_failed_guess(guesser: Any) -> None:
    """Outside review: a non-staff user signing in at /admin/login/ with their right password
    (refused there: not staff) was counted as guessing, and five such visits locked them out
    of /login/. Wrong passwords at the admin still count against /login/."""
    admin_page = Client(REMOTE_ADDR=ATTACKER)
    right = {"username": "oscar", "password": PASSWORD}
    for _ in range(5):
        refused = admin_page.post("/admin/login/", right).content.decode()
        assert "Too many failed sign-in attempts" not in refused
        assert "staff account" in refused  # the admin's own refusal of a non-staff user
    assert _sign_in("oscar", PASSWORD).status_code == 302
    for _ in range(3):
        admin_page.post("/admin/login/", {"username": "oscar", "password": "guess"})
    assert _sign_in("oscar", PASSWORD).status_code == 429


def test_invalid_api_tokens_are_throttled_per_address(guesser: Any) -> None:
    _token, key = ApiToken.issue(guesser, "ci", ["read:usage"])
    api = Client(REMOTE_ADDR="203.0.113.9")
    for n in range(5):
        assert api.get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer gps_guess{n}").status_code == 401
    blocked = api.get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert blocked.status_code == 429 and "Too many invalid API tokens" in blocked.json()["detail"]
    other = Client(REMOTE_ADDR=OWNER_HOME).get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert other.status_code == 200


# --- through the ASGI application, as uvicorn hands requests over ----------------------------


def _api_call(app: Any, peer: str, forwarded_for: str | None, key: str) -> int:
    """One GET /api/v1/usage/ arriving over a connection from ``peer``."""
    headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {key}".encode())]
    if forwarded_for is not None:
        headers.append((b"x-forwarded-for", forwarded_for.encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": "/api/v1/usage/", "raw_path": b"/api/v1/usage/", "query_string": b"",
        "headers": headers, "client": (peer, 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip

    async def call() -> int:
        communicator = ApplicationCommunicator(app, scope)
        await communicator.send_input({"type": "http.request", "body": b""})
        start = await communicator.receive_output(timeout=20)
        await communicator.receive_output(timeout=20)  # the body
        # Django closes the response (request_finished: the database connection goes back to
        # the pool) after the body is sent; the loop must not end before that, as no server's does.
        await communicator.wait(timeout=20)
        return int(start["status"])

    return asyncio.run(call())


@pytest.mark.django_db(transaction=True)  # the ASGI handler runs the view in its own thread
def test_a_client_cannot_pick_its_address_with_x_forwarded_for(guesser: Any) -> None:
    """Straight to the server (no trusted proxy): a new X-Forwarded-For per request is ignored,
    every guess counts against the connection's own address."""
    from portal.asgi import build

    app = build([])
    for n in range(5):
        assert _api_call(app, ATTACKER, f"192.0.2.{n}", f"gps_guess{n}") == 401
    assert _api_call(app, ATTACKER, "192.0.2.99", "gps_guess") == 429


@pytest.mark.django_db(transaction=True)  # the ASGI handler runs the view in its own thread
def test_behind_a_trusted_proxy_its_header_names_the_client(guesser: Any) -> None:
    """Through the proxy at 10.0.0.1 (TRUSTED_PROXIES): the client it names is counted, not
    the proxy, and not what the client put first in the header."""
    from portal.asgi import build

    _token, key = ApiToken.issue(guesser, "ci", ["read:usage"])
    app = build(["10.0.0.1"])
    for n in range(5):
        assert _api_call(app, "10.0.0.1", f"forged-{n}, {ATTACKER}", f"gps_guess{n}") == 401
    assert _api_call(app, "10.0.0.1", ATTACKER, key) == 429  # that client is blocked
    assert _api_call(app, "10.0.0.1", OWNER_HOME, key) == 200  # another behind the proxy is not
