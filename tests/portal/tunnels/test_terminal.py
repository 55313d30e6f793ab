"""The web terminal's relay, end to end in one process: the browser's WebSocket, the Redis
Redis streams, and the agent's relay (``wire.relay``) over a pty stand-in.
The real ptys (Docker exec, bubblewrap) have their own driver tests; the browser test
types ``echo hi`` into a real container."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.utils import timezone
from redis.asyncio import Redis

from portal.asgi import application
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.portal.helpers import client_for, place_all, request
from wire.relay import relay

pytestmark = pytest.mark.django_db(transaction=True)  # the consumers read in their own thread
# How long a test waits for a message through Redis and the relay's threads: generous, as
# CI runs the suite beside the ledger test on two cores; a message on time ends the wait.
WAIT_S = 30


class EchoShell:
    """Answers each line written with what a shell running ``echo`` would print."""

    def __init__(self) -> None:
        self.out: queue.Queue[bytes] = queue.Queue()
        self.size: tuple[int, int] | None = None
        self.closed = False

    def write(self, data: bytes) -> None:
        line = data.decode().strip()
        self.out.put(f"$ {line}\r\n{line.removeprefix('echo ')}\r\n".encode())
        if line == "exit":
            self.out.put(b"")

    def read(self, timeout_s: float = 0.1) -> bytes:
        try:
            data = self.out.get(timeout=timeout_s)
        except queue.Empty:
            return b""
        if data == b"":
            raise EOFError("shell exited")
        return data

    def resize(self, rows: int, cols: int) -> None:
        self.size = (rows, cols)

    def close(self) -> None:
        self.closed = True


def running_sandbox(people: Any, catalog: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c1"}, timezone.now())
    sandbox.refresh_from_db()
    return sandbox


def communicator(user: Any, sandbox_id: int) -> WebsocketCommunicator:
    cookie = f"sessionid={client_for(user).cookies['sessionid'].value}".encode()
    return WebsocketCommunicator(
        application,
        f"/ws/sandboxes/{sandbox_id}/terminal/",
        headers=[(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)],
    )


def test_keystrokes_reach_the_shell_and_its_output_comes_back(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running_sandbox(people, catalog)
    host_queue = f"host.{sandbox.host.name}"  # type: ignore[union-attr]
    shell = EchoShell()
    comm = communicator(people["owner"], sandbox.pk)

    async def run() -> tuple[bytes, str]:
        connected, _ = await comm.connect()
        assert connected
        deadline = time.monotonic() + WAIT_S
        while not any(t[1] == "open_terminal" for t in sent_tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        [(queue_name, _task, (session, key, handle))] = [t for t in sent_tasks if t[1] == "open_terminal"]
        assert queue_name == host_queue and key == sandbox.allocation_key
        assert handle == {"driver": "docker", "ref": "c1"}
        host = queue_name.removeprefix("host.")
        agent = asyncio.create_task(
            relay(Redis.from_url(settings.REDIS_URL), shell, host, session, idle_s=30)
        )
        assert json.loads(await comm.receive_from(timeout=WAIT_S)) == {"type": "opened"}
        await comm.send_to(text_data=json.dumps({"type": "resize", "rows": 30, "cols": 100}))
        await comm.send_to(text_data=json.dumps({"type": "input", "data": "echo hi\n"}))
        output = await comm.receive_from(timeout=WAIT_S)
        await comm.send_to(text_data=json.dumps({"type": "input", "data": "exit\n"}))
        seen = b""
        while True:
            message = await comm.receive_output(timeout=WAIT_S)
            if message["type"] == "websocket.close":
                break
            if message.get("text"):
                closing = json.loads(message["text"])
            else:
                seen += message["bytes"]
        await agent
        return output, closing["reason"]

    output, reason = asyncio.run(run())
    assert output == b"$ echo hi\r\nhi\r\n" and reason == "shell exited"
    assert shell.size == (30, 100) and shell.closed
    assert sandbox.events.filter(message="terminal opened by olivia").count() == 1


@pytest.mark.parametrize(
    ("persona", "state", "code", "says"),
    [
        ("outsider", "running", 4403, "Only the sandbox's owner"),
        ("member", "running", 4403, "Only the sandbox's owner"),  # a member who does not own it
        ("owner", "stopped", 4409, "The sandbox is stopped, not running."),
        ("admin", "running", None, ""),
    ],
)
def test_who_may_open_a_terminal(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    persona: str,
    state: str,
    code: int | None,
    says: str,
) -> None:
    sandbox = running_sandbox(people, catalog)
    if state == "stopped":
        actions.do_request_stop(sandbox.pk, people["owner"])
        actions.do_mark_stopped(sandbox.allocation_key, timezone.now())
    comm = communicator(people[persona], sandbox.pk)

    async def run() -> tuple[Any, Any]:
        await comm.connect()
        if code is None:
            quiet = await comm.receive_nothing(timeout=0.3)
            await comm.disconnect()
            return quiet, None
        first = json.loads(await comm.receive_from(timeout=WAIT_S))
        closed = await comm.receive_output(timeout=WAIT_S)
        return first, closed

    first, closed = asyncio.run(run())
    if code is None:
        assert first is True and any(t[1] == "open_terminal" for t in sent_tasks)
    else:
        assert first["type"] == "closed" and first["reason"].startswith(says)
        assert closed == {"type": "websocket.close", "code": code}
        assert not any(t[1] == "open_terminal" for t in sent_tasks)


def test_a_simulated_sandbox_offers_no_terminal_and_its_pages_say_simulated(
    people: Any, catalog: Any, sent_tasks: Any
) -> None:
    """On a host whose driver keeps state only (the cluster twin), nothing runs to open a shell
    into: the page offers none, the socket refuses, and the pages badge the sandbox."""
    from tests.conftest import seed_host

    seed_host("twin-1", "H100-80GB:2", {0: "dedicated", 1: "dedicated"}, driver="simulated")
    sandbox = running_sandbox(people, catalog)
    assert sandbox.host is not None and sandbox.host.simulated_sandboxes
    owner = client_for(people["owner"])
    page = owner.get(f"/sandboxes/{sandbox.pk}/").content.decode()
    assert "simulated sandbox" in page and "Open terminal" not in page
    assert (
        "A shell: none. This sandbox is simulated" in page
        and "the <strong>Terminal</strong> below" not in page
    )
    assert "simulated sandbox" in owner.get("/sandboxes/").content.decode()
    assert "simulated sandboxes" in client_for(people["admin"]).get("/console/fleet/").content.decode()
    comm = communicator(people["owner"], sandbox.pk)

    async def run() -> tuple[Any, Any]:
        await comm.connect()
        return json.loads(await comm.receive_from(timeout=WAIT_S)), await comm.receive_output(timeout=WAIT_S)

    first, closed = asyncio.run(run())
    assert first["type"] == "closed" and first["reason"].startswith("The sandbox is simulated")
    assert closed == {"type": "websocket.close", "code": 4409}
    assert not any(t[1] == "open_terminal" for t in sent_tasks)
