"""SSH's WebSocket (portal/tunnels/ssh.py) through the real ASGI application, the Redis
streams and the agent's relay (``wire.relay``) over a byte-echoing stand-in for sshd: the
connection's bytes both ways as binary frames; who may open one (the terminal's rules, from
the other tenant's side, a token without the scope, no key); which keys the agent is told to
let in (the connecting user's alone); and the close once access goes. The real sshd, through
the real portal and the real OpenSSH client: tests/cli/test_ssh_e2e.py."""

from __future__ import annotations

import asyncio
import json
import queue
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.utils import timezone
from redis.asyncio import Redis

from portal.accounts import tokens
from portal.accounts.models import ApiToken
from portal.accounts.ssh_keys import do_add_key
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.portal.accounts.test_ssh_keys import ECDSA, ED25519
from tests.portal.helpers import place_all, request
from tests.portal.tunnels.test_terminal import WAIT_S, running_sandbox
from tests.portal.tunnels.test_terminal_tokens import token_for, token_socket
from wire.relay import relay

pytestmark = pytest.mark.django_db(transaction=True)  # the consumers read in their own thread
ALL = list(ApiToken.Scope.values)


class EchoServer:
    """What comes in goes back out, as bytes: a stand-in for sshd's stdin and stdout."""

    def __init__(self) -> None:
        self.out: queue.Queue[bytes] = queue.Queue()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out.put(b"" if data == b"QUIT" else data)

    def read(self, timeout_s: float = 0.1) -> bytes:
        try:
            data = self.out.get(timeout=timeout_s)
        except queue.Empty:
            return b""
        if data == b"":
            raise EOFError("the SSH connection ended")
        return data

    def resize(self, rows: int, cols: int) -> None:
        raise AssertionError("nothing resizes an SSH connection's stream")

    def close(self) -> None:
        self.closed = True


def ssh_socket(sandbox_id: int, key: str) -> WebsocketCommunicator:
    return token_socket(sandbox_id, f"Bearer {key}", f"/ws/sandboxes/{sandbox_id}/ssh/")


async def opened_task(sent_tasks: list[Any]) -> tuple[Any, ...]:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not any(t[1] == "open_ssh" for t in sent_tasks):
        assert asyncio.get_running_loop().time() < deadline, sent_tasks
        await asyncio.sleep(0.02)
    [(queue_name, _task, args)] = [t for t in sent_tasks if t[1] == "open_ssh"]
    return (queue_name.removeprefix("host."), *args)


async def refusal(comm: WebsocketCommunicator) -> tuple[str, int]:
    connected, _ = await comm.connect(timeout=WAIT_S)
    assert connected  # refusals are accepted, told why, then closed, as the terminal's
    first = json.loads(await comm.receive_from(timeout=WAIT_S))
    closed = await comm.receive_output(timeout=WAIT_S)
    assert first["type"] == "closed" and closed["type"] == "websocket.close", (first, closed)
    return first["reason"], closed["code"]


def test_the_connections_bytes_go_both_ways_as_binary_frames(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    do_add_key(people["owner"], "laptop", ED25519)
    server = EchoServer()
    comm = ssh_socket(sandbox.pk, token_for(people["owner"], ["write:sandboxes"]))

    async def run() -> tuple[tuple[Any, ...], bytes, str]:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        task = await opened_task(sent_tasks)
        host, session = task[0], task[1]
        agent = asyncio.create_task(
            relay(Redis.from_url(settings.REDIS_URL), server, host, session, idle_s=30)
        )
        assert json.loads(await comm.receive_from(timeout=WAIT_S)) == {"type": "opened"}
        await comm.send_to(bytes_data=b"SSH-2.0-OpenSSH_9.2\r\n\x00\xff")
        echoed = await comm.receive_from(timeout=WAIT_S)
        await comm.send_to(text_data="ignored: the client's bytes are binary")
        await comm.send_to(bytes_data=b"QUIT")
        closing = json.loads(await comm.receive_from(timeout=WAIT_S))
        assert (await comm.receive_output(timeout=WAIT_S))["type"] == "websocket.close"
        await asyncio.wait_for(agent, WAIT_S)
        return task, echoed, closing["reason"]

    task, echoed, reason = asyncio.run(run())
    assert echoed == b"SSH-2.0-OpenSSH_9.2\r\n\x00\xff" and reason == "the SSH connection ended"
    assert task[2] == sandbox.allocation_key and task[4] == [" ".join(ED25519.split()[:2])]
    assert server.closed
    assert sandbox.events.filter(message="ssh opened by olivia").count() == 1


@pytest.mark.parametrize(
    ("persona", "scopes", "code", "says"),
    [
        (
            "outsider",
            ALL,
            4403,
            "Only the sandbox's owner, a manager of its project or an admin can open an SSH",
        ),
        ("member", ALL, 4403, "Only the sandbox's owner"),  # same project, neither owner nor manager
        ("owner", ["read:usage"], 4403, "This API token lacks the scope 'write:sandboxes' an SSH connection"),
        ("admin", ["read:usage", "write:sandboxes"], 4403, "Only the sandbox's owner"),  # staff, no admin
    ],
)
def test_who_may_open_an_ssh_connection(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    persona: str,
    scopes: list[str],
    code: int,
    says: str,
) -> None:
    sandbox = running_sandbox(people, catalog)
    for who in ("owner", "member", "outsider", "admin"):
        do_add_key(people[who], who, ED25519)
    reason, closed = asyncio.run(refusal(ssh_socket(sandbox.pk, token_for(people[persona], scopes))))
    assert closed == code and reason.startswith(says), reason
    assert not any(t[1] == "open_ssh" for t in sent_tasks)
    assert not sandbox.events.filter(message__startswith="ssh opened").exists()


def test_no_key_or_no_running_sandbox_is_refused_saying_so(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    key = token_for(people["owner"], ["write:sandboxes"])
    reason, code = asyncio.run(refusal(ssh_socket(sandbox.pk, key)))
    assert code == 4409 and reason.startswith("You have no SSH key on your account"), reason
    do_add_key(people["owner"], "laptop", ED25519)
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, timezone.now())
    reason, code = asyncio.run(refusal(ssh_socket(sandbox.pk, key)))
    assert (reason, code) == ("The sandbox is stopped, not running.", 4409)
    assert not any(t[1] == "open_ssh" for t in sent_tasks)


def test_a_manager_logs_in_to_a_members_sandbox_with_the_managers_keys_alone(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    marks = request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    marks.refresh_from_db()
    actions.do_mark_running(marks.allocation_key, {"driver": "docker", "ref": "c2"}, timezone.now())
    do_add_key(people["member"], "mark", ED25519)
    do_add_key(people["owner"], "olivia", ECDSA)  # olivia manages Vision
    comm = ssh_socket(marks.pk, token_for(people["owner"], ["write:sandboxes"]))

    async def run() -> tuple[Any, ...]:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        task = await opened_task(sent_tasks)
        await comm.disconnect()
        return task

    assert asyncio.run(run())[4] == [" ".join(ECDSA.split()[:2])]
    assert Sandbox.objects.get(pk=marks.pk).events.filter(message="ssh opened by olivia").count() == 1


@pytest.mark.parametrize("how", ["revoked", "stopped"])
def test_an_open_connection_closes_once_access_goes(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, settings: Any, how: str
) -> None:
    settings.STREAM_RECHECK_S = 1
    sandbox = running_sandbox(people, catalog)
    do_add_key(people["owner"], "laptop", ED25519)
    key = token_for(people["owner"], ALL)
    comm = ssh_socket(sandbox.pk, key)

    def take_it_away() -> None:
        if how == "revoked":
            tokens.do_revoke_token(people["owner"], ApiToken.objects.get(key_prefix=key[:12]).pk)
        else:
            Sandbox.objects.filter(pk=sandbox.pk).update(state="stopped")

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert connected
        host, session, *_ = await opened_task(sent_tasks)
        agent = asyncio.create_task(
            relay(Redis.from_url(settings.REDIS_URL), EchoServer(), host, session, idle_s=30)
        )
        assert json.loads(await comm.receive_from(timeout=WAIT_S)) == {"type": "opened"}
        await asyncio.to_thread(take_it_away)
        closing = json.loads(await comm.receive_from(timeout=WAIT_S))
        closed = await comm.receive_output(timeout=WAIT_S)
        await comm.disconnect()
        await asyncio.wait_for(agent, WAIT_S)  # the agent's side ends too
        return closing, closed

    closing, closed = asyncio.run(run())
    assert closing == {
        "type": "closed",
        "reason": "The sandbox is no longer running, or you may no longer reach it over SSH.",
    }
    assert closed == {"type": "websocket.close", "code": 4403}
