"""The sandbox terminal's WebSocket opened with an API token (the ``gpushare shell``
client's way in: portal/accounts/socket_auth.py), through the real ASGI application.

A token socket needs no Origin (a browser cannot send the header) but the token scope that
typing into a sandbox takes; it has the token's reach, never a session's; it is closed once
the token is revoked or expires or its user is deactivated; invalid tokens count against the
address as on the HTTP API. Cookie sockets keep their Origin check."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.core.cache import cache
from django.test import Client
from django.utils import timezone
from redis.asyncio import Redis

from portal.accounts import socket_auth, tokens
from portal.accounts.models import ApiToken
from portal.accounts.streams import current_user
from portal.asgi import application
from tests.portal.helpers import client_for
from tests.portal.tunnels.test_terminal import WAIT_S, EchoShell, running_sandbox
from wire.relay import relay

pytestmark = pytest.mark.django_db(transaction=True)  # the consumers read in their own thread
ALL = list(ApiToken.Scope.values)
ADDRESS = "203.0.113.40"


@pytest.fixture(autouse=True)
def _fresh_throttle() -> Any:
    cache.clear()  # invalid-token counts live in the cache, per address
    yield
    cache.clear()


def token_for(user: Any, scopes: list[str]) -> str:
    _, key = ApiToken.issue(user, "cli", scopes, expires_at=timezone.now() + timedelta(days=7))
    return key


def token_socket(sandbox_id: int, authorization: str, path: str | None = None) -> WebsocketCommunicator:
    """As the command-line client connects: a bearer token, no Origin, no cookie."""
    comm = WebsocketCommunicator(
        application,
        path or f"/ws/sandboxes/{sandbox_id}/terminal/",
        headers=[(b"host", b"localhost"), (b"authorization", authorization.encode())],
    )
    comm.scope["client"] = (ADDRESS, 50000)
    return comm


async def refusal(comm: WebsocketCommunicator) -> tuple[str, int]:
    """The ``closed`` message's reason and the close code of a refused socket."""
    connected, _ = await comm.connect(timeout=WAIT_S)
    assert connected  # refusals are accepted, told why, then closed
    first = json.loads(await comm.receive_from(timeout=WAIT_S))
    closed = await comm.receive_output(timeout=WAIT_S)
    assert first["type"] == "closed" and closed["type"] == "websocket.close", (first, closed)
    return first["reason"], closed["code"]


async def wait_for_open_task(sent_tasks: list[Any]) -> tuple[Any, ...]:
    deadline = time.monotonic() + WAIT_S
    while not any(t[1] == "open_terminal" for t in sent_tasks) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    [(queue, _task, args)] = [t for t in sent_tasks if t[1] == "open_terminal"]
    return (queue.removeprefix("host."), *args)


def test_a_write_token_types_into_the_shell_without_an_origin(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    shell = EchoShell()
    comm = token_socket(sandbox.pk, f"Bearer {token_for(people['owner'], ['write:sandboxes'])}")

    async def run() -> bytes:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        host, session, _key, _handle = await wait_for_open_task(sent_tasks)
        agent = asyncio.create_task(
            relay(Redis.from_url(settings.REDIS_URL), shell, host, session, idle_s=30)
        )
        assert json.loads(await comm.receive_from(timeout=WAIT_S)) == {"type": "opened"}
        await comm.send_to(text_data=json.dumps({"type": "input", "data": "echo hi\n"}))
        output = await comm.receive_from(timeout=WAIT_S)
        await comm.send_to(text_data=json.dumps({"type": "input", "data": "exit\n"}))
        while (await comm.receive_output(timeout=WAIT_S))["type"] != "websocket.close":
            pass
        await agent
        return output

    assert asyncio.run(run()) == b"$ echo hi\r\nhi\r\n"
    assert sandbox.events.filter(message="terminal opened by olivia").count() == 1


@pytest.mark.parametrize(
    ("persona", "scopes", "says"),
    [
        ("outsider", ALL, "Only the sandbox's owner"),  # another tenant's token
        ("member", ALL, "Only the sandbox's owner"),  # same project, not the owner nor a manager
        ("owner", ["read:usage"], "This API token lacks the scope 'write:sandboxes'"),
        ("admin", ["read:usage", "write:sandboxes"], "Only the sandbox's owner"),  # staff without admin
    ],
)
def test_who_may_open_a_terminal_with_a_token(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, persona: str, scopes: list[str], says: str
) -> None:
    sandbox = running_sandbox(people, catalog)
    comm = token_socket(sandbox.pk, f"Bearer {token_for(people[persona], scopes)}")
    reason, code = asyncio.run(refusal(comm))
    assert code == 4403 and reason.startswith(says), reason
    assert not any(t[1] == "open_terminal" for t in sent_tasks)


def test_a_staff_token_with_the_admin_scope_reaches_any_sandbox(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    comm = token_socket(sandbox.pk, f"Bearer {token_for(people['admin'], ['admin'])}")

    async def run() -> tuple[Any, ...]:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        args = await wait_for_open_task(sent_tasks)
        await comm.disconnect()
        return args

    assert asyncio.run(run())[2] == sandbox.allocation_key


@pytest.mark.parametrize(
    ("authorization", "code", "says"),
    [
        ("Bearer gps_not-a-token", 4401, "Invalid or revoked API token."),
        ("Basic b2xpdmlhOnB3", 4401, "The Authorization header must be 'Bearer <token>'."),
        ("Bearer", 4401, "The Authorization header must be 'Bearer <token>'."),
    ],
)
def test_a_bad_token_is_refused_before_the_route(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, authorization: str, code: int, says: str
) -> None:
    sandbox = running_sandbox(people, catalog)
    assert asyncio.run(refusal(token_socket(sandbox.pk, authorization))) == (says, code)
    assert not any(t[1] == "open_terminal" for t in sent_tasks)


def test_revoked_and_expired_tokens_and_inactive_users_are_refused(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    revoked = token_for(people["owner"], ALL)
    ApiToken.objects.filter(key_prefix=revoked[:12]).update(revoked_at=timezone.now())
    expired = token_for(people["owner"], ALL)
    ApiToken.objects.filter(key_prefix=expired[:12]).update(expires_at=timezone.now() - timedelta(hours=1))
    assert asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer {revoked}")))[1] == 4401
    reason, code = asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer {expired}")))
    assert code == 4401 and reason.startswith("This API token expired on ")
    inactive = token_for(people["owner"], ALL)
    people["owner"].is_active = False
    people["owner"].save(update_fields=["is_active"])
    assert asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer {inactive}")))[1] == 4401


def test_other_sockets_take_no_token(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    """The samples' consumers scope by the user's projects, not a token's reach: not for tokens."""
    sandbox = running_sandbox(people, catalog)
    key = token_for(people["owner"], ALL)
    for path in ("/ws/fleet/", f"/ws/sandboxes/{sandbox.pk}/", f"/sandboxes/{sandbox.pk}/app/"):
        reason, code = asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer {key}", path)))
        assert code == 4404 and "does not take API tokens" in reason, path


def test_a_cookie_socket_still_needs_its_origin(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    cookie = f"sessionid={client_for(people['owner']).cookies['sessionid'].value}".encode()
    for origin in (None, b"http://evil.example"):
        headers = [(b"host", b"localhost"), (b"cookie", cookie)] + ([(b"origin", origin)] if origin else [])
        comm = WebsocketCommunicator(application, f"/ws/sandboxes/{sandbox.pk}/terminal/", headers=headers)
        connected, _ = asyncio.run(comm.connect(timeout=WAIT_S))
        assert not connected, origin
    assert not any(t[1] == "open_terminal" for t in sent_tasks)


def test_invalid_socket_tokens_count_with_the_apis_and_lock_the_address_out(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, settings: Any
) -> None:
    settings.LOGIN_IP_FAILURE_LIMIT = 4
    sandbox = running_sandbox(people, catalog)
    key = token_for(people["owner"], ALL)
    api = Client(REMOTE_ADDR=ADDRESS)
    for n in range(2):  # two guesses on the API, two on the socket, from one address
        assert api.get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer gps_guess{n}").status_code == 401
        assert asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer gps_guess{n}")))[1] == 4401
    reason, code = asyncio.run(refusal(token_socket(sandbox.pk, f"Bearer {key}")))  # even a valid one
    assert code == 4429 and reason.startswith("Too many invalid API tokens from here")
    assert api.get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 429
    assert not any(t[1] == "open_terminal" for t in sent_tasks)


EXPIRED_AT = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("unknown", "Invalid or revoked API token."),
        ("revoked", "Invalid or revoked API token."),
        ("expired", "This API token expired on 2026-01-02 03:04 UTC: make a new one."),
        # The socket said "expired on ..." of a deactivated user's token; the API said no
        # more than of an unknown key, the stricter answer, which both give now.
        ("expired, user deactivated", "Invalid or revoked API token."),
    ],
)
def test_the_api_and_a_socket_refuse_a_token_in_the_same_words(
    people: Any, sent_tasks: Any, case: str, says: str
) -> None:
    """One check (tokens.check_api_token) behind the API, a token socket and the recheck of
    an open one, where three copies had drifted apart."""
    key = token_for(people["owner"], ALL)
    open_socket = opened_with(key)  # while the token was good
    if case == "revoked":
        ApiToken.objects.filter(key_prefix=key[:12]).update(revoked_at=timezone.now())
    if case.startswith("expired"):
        ApiToken.objects.filter(key_prefix=key[:12]).update(expires_at=EXPIRED_AT)
    if case.endswith("deactivated"):
        people["owner"].is_active = False
        people["owner"].save(update_fields=["is_active"])
    presented = "gps_unknown" if case == "unknown" else key
    over_http = Client(REMOTE_ADDR=ADDRESS).get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {presented}")
    assert over_http.status_code == 401 and over_http.json()["detail"] == says
    assert asyncio.run(refusal(token_socket(1, f"Bearer {presented}"))) == (says, 4401)
    if case != "unknown":
        assert current_user(open_socket) is None  # the socket opened with it is closed


def opened_with(key: str) -> dict[str, Any]:
    """The scope of a token socket opened with ``key``, as its consumer holds it."""
    handshake = {"headers": [(b"authorization", f"Bearer {key}".encode())], "client": (ADDRESS, 50000)}
    verdict = socket_auth.authenticate(f"Bearer {key}", handshake)
    assert not isinstance(verdict, socket_auth.Refusal), verdict
    user, token = verdict
    return {**handshake, "user": user, socket_auth.SCOPE_KEY: token}


def test_a_locked_out_address_hears_the_same_on_the_api_and_a_socket(
    people: Any, sent_tasks: Any, settings: Any
) -> None:
    settings.LOGIN_IP_FAILURE_LIMIT, settings.LOGIN_LOCKOUT_SECONDS = 1, 600
    key = token_for(people["owner"], ALL)
    open_socket = opened_with(key)
    api = Client(REMOTE_ADDR=ADDRESS)
    assert api.get("/api/v1/usage/", HTTP_AUTHORIZATION="Bearer gps_guess").status_code == 401
    locked = api.get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}")
    says = "Too many invalid API tokens from here: wait 10 minutes."
    assert locked.status_code == 429 and locked["Retry-After"] == "600" and locked.json()["detail"] == says
    assert asyncio.run(refusal(token_socket(1, f"Bearer {key}"))) == (says, 4429)
    # An open socket's recheck is no guess: the lockout of its address does not close it.
    assert current_user(open_socket) == people["owner"]


@pytest.mark.parametrize("how", ["revoked", "expired", "deactivated"])
def test_an_open_shell_closes_once_its_token_is_revoked_or_expires(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, settings: Any, how: str
) -> None:
    settings.STREAM_RECHECK_S = 1
    sandbox = running_sandbox(people, catalog)
    key = token_for(people["owner"], ALL)
    token = ApiToken.objects.get(key_prefix=key[:12])
    comm = token_socket(sandbox.pk, f"Bearer {key}")

    def take_it_away() -> None:
        if how == "revoked":
            tokens.do_revoke_token(people["owner"], token.pk)
        elif how == "expired":
            ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
        else:
            people["owner"].is_active = False
            people["owner"].save(update_fields=["is_active"])

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        host, session, _key, _handle = await wait_for_open_task(sent_tasks)
        shell = EchoShell()
        agent = asyncio.create_task(
            relay(Redis.from_url(settings.REDIS_URL), shell, host, session, idle_s=30)
        )
        assert json.loads(await comm.receive_from(timeout=WAIT_S)) == {"type": "opened"}
        await asyncio.to_thread(take_it_away)
        closing = json.loads(await comm.receive_from(timeout=WAIT_S))
        closed = await comm.receive_output(timeout=WAIT_S)
        await comm.disconnect()  # as the client answers the close
        await asyncio.wait_for(agent, WAIT_S)  # the agent's side ends too
        return closing, closed

    closing, closed = asyncio.run(run())
    assert closing == {
        "type": "closed",
        "reason": "The sandbox is no longer running, or you may no longer use its terminal.",
    }
    assert closed == {"type": "websocket.close", "code": 4403}
