"""A sandbox's web app through the portal, end to end in one process: the ASGI route and
its HTTP consumer, the Redis channel layer, and the agent's relay (``relay_stream`` with the
drivers' unix-socket connection) to a real HTTP server on a unix socket. The real sandboxes
(JupyterLab in a container, in Chromium) have their own tests."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from channels.testing import HttpCommunicator, WebsocketCommunicator

from portal.asgi import application
from portal.sandboxes.models import Sandbox
from tests.factories import ImageFactory
from tests.portal.helpers import client_for
from tests.portal.test_terminal import WAIT_S, running_sandbox
from workers.drivers import app_socket
from workers.drivers.base import SandboxHandle
from workers.host.terminals import relay_stream

pytestmark = pytest.mark.django_db(transaction=True)  # the consumer reads in its own thread
BIG = 3 * 1024 * 1024


class App(BaseHTTPRequestHandler):
    """What an app in a sandbox would answer: what it was asked, and cookies of its own."""

    def do_GET(self) -> None:
        if self.path.endswith("/big"):
            self._answer(b"x" * BIG)
            return
        seen = {"path": self.path, "cookie": self.headers.get("cookie", ""), "host": self.headers.get("host")}
        self._answer(json.dumps(seen).encode(), cookies=["sessionid=planted; Path=/", "_xsrf=abc; Path=/"])

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self._answer(b"got " + body)

    def _answer(self, body: bytes, cookies: tuple[str, ...] | list[str] = ()) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        for cookie in cookies:
            self.send_header("set-cookie", cookie)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class UnixHttpServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


@pytest.fixture
def app_root() -> Iterator[Path]:
    # Short: the test's server binds the socket by its path (107 bytes at most); the agent's
    # side connects through the directory's descriptor, whatever its depth.
    root = Path(tempfile.mkdtemp(prefix="apps-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def serve_app(root: Path, sandbox: Sandbox) -> UnixHttpServer:
    folder = root / sandbox.allocation_key
    folder.mkdir(parents=True)
    server = UnixHttpServer(str(folder / "app.sock"), App)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def with_app(sandbox: Sandbox) -> Sandbox:
    sandbox.image = ImageFactory(name="jupyter", reference="gpushare/notebook:1", app="JupyterLab")  # type: ignore[assignment]
    sandbox.save(update_fields=["image"])
    return sandbox


def fetch(
    user: Any, path: str, method: str = "GET", body: bytes = b"", root: Path | None = None, sent: Any = None
) -> dict[str, Any]:
    """The portal's answer to ``user``'s request, the agent's part played by ``relay_stream``
    on the host's side of ``root`` (when the portal asks for a connection)."""
    return fetch_all(user, [(path, method, body)], root, sent)[0]


def fetch_all(
    user: Any, requests: list[tuple[str, str, bytes]], root: Path | None = None, sent: Any = None
) -> list[dict[str, Any]]:
    """Several requests in one event loop: the channel layer's locks belong to the loop that
    made them, so a second ``asyncio.run`` would meet the first one's."""
    cookie = f"sessionid={client_for(user).cookies['sessionid'].value}; _xsrf=abc".encode()

    async def one(path: str, method: str, body: bytes) -> dict[str, Any]:
        comm = HttpCommunicator(
            application, method, path, body=body, headers=[(b"host", b"localhost"), (b"cookie", cookie)]
        )
        answer = asyncio.create_task(comm.get_response(timeout=WAIT_S))
        deadline = time.monotonic() + WAIT_S
        while not answer.done() and time.monotonic() < deadline:
            asked = [t for t in (sent or []) if t[1] == "open_app"]
            if asked and root is not None:
                sent.remove(asked[0])
                _, _, (session, key, _handle) = asked[0]
                handle = SandboxHandle("process", key, 0, "pid")
                opener = functools.partial(lambda folder, k, _h: app_socket.connect(folder, k), root, key)
                relay_stream(opener, "h", session, key, handle, 30, "app")
            await asyncio.sleep(0.02)
        return await answer

    async def run() -> list[dict[str, Any]]:
        return [await one(*request) for request in requests]

    return asyncio.run(run())


def headers(answer: dict[str, Any], name: bytes) -> list[bytes]:
    return [v for k, v in answer["headers"] if k.lower() == name]


def test_the_owner_reaches_the_app_without_the_portals_cookies(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    server = serve_app(app_root, sandbox)
    try:
        base = f"/sandboxes/{sandbox.pk}/app"
        answer, big, posted = fetch_all(
            people["owner"],
            [
                (f"{base}/lab?reset=1", "GET", b""),
                (f"{base}/big", "GET", b""),
                (f"{base}/api", "POST", b'{"cell": 1}'),
            ],
            app_root,
            sent_tasks,
        )
        assert answer["status"] == 200, answer
        seen = json.loads(answer["body"])
        assert seen["path"] == f"{base}/lab?reset=1" and seen["host"] == "localhost"
        assert seen["cookie"] == "_xsrf=abc"  # the portal's session never reaches the app
        assert headers(answer, b"set-cookie") == [b"_xsrf=abc; Path=/"]  # nor may it set one

        assert big["status"] == 200 and big["body"] == b"x" * BIG
        assert posted["body"] == b'got {"cell": 1}'
    finally:
        server.shutdown()
        server.server_close()


def test_an_app_not_listening_yet_is_a_page_that_tries_again(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    answer = fetch(people["owner"], f"/sandboxes/{sandbox.pk}/app/lab", root=app_root, sent=sent_tasks)
    assert answer["status"] == 503 and b"is starting" in answer["body"]
    assert headers(answer, b"refresh") == [b"2"]


@pytest.mark.parametrize(
    ("persona", "change", "status", "says"),
    [
        ("outsider", "", 403, b"Only the sandbox's owner"),
        ("member", "", 403, b"Only the sandbox's owner"),
        ("admin", "", 403, b"Only the sandbox's owner"),  # the app's scripts would run as the admin
        ("owner", "stopped", 409, b"not running"),
        ("owner", "no app", 404, b"serves no app"),
    ],
)
def test_who_may_open_an_app(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    persona: str,
    change: str,
    status: int,
    says: bytes,
) -> None:
    sandbox = running_sandbox(people, catalog)
    if change != "no app":
        with_app(sandbox)
    if change == "stopped":
        Sandbox.objects.filter(pk=sandbox.pk).update(state="stopped")
    answer = fetch(people[persona], f"/sandboxes/{sandbox.pk}/app/lab")
    assert answer["status"] == status and says in answer["body"]
    assert not [t for t in sent_tasks if t[1] == "open_app"]  # the host was never asked


def ws_app(root: Path, sandbox: Sandbox) -> Any:
    """An app's WebSocket on its socket: echoes each message, and says which subprotocol it took."""
    from websockets.sync.server import unix_serve

    def echo(connection: Any) -> None:
        connection.send(f"hello over {connection.subprotocol}")
        for message in connection:
            connection.send(message)

    folder = root / sandbox.allocation_key
    folder.mkdir(parents=True)
    server = unix_serve(echo, str(folder / "app.sock"), subprotocols=["v1.kernel.websocket.jupyter.org"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def ws_communicator(user: Any, path: str) -> WebsocketCommunicator:
    cookie = f"sessionid={client_for(user).cookies['sessionid'].value}; _xsrf=abc".encode()
    return WebsocketCommunicator(
        application,
        path,
        headers=[(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)],
        subprotocols=["v1.kernel.websocket.jupyter.org"],
    )


async def play_agent(sent: list[Any], root: Path, until: asyncio.Task[Any]) -> None:
    """The host agent's part: each ``open_app`` the portal sends, relayed to ``root``'s socket."""
    deadline = time.monotonic() + WAIT_S
    while not until.done() and time.monotonic() < deadline:
        for asked in [t for t in sent if t[1] == "open_app"]:
            sent.remove(asked)
            _, _, (session, key, _handle) = asked
            opener = functools.partial(lambda folder, k, _h: app_socket.connect(folder, k), root, key)
            relay_stream(opener, "h", session, key, SandboxHandle("process", key, 0, "pid"), 30, "app")
        await asyncio.sleep(0.02)


def test_the_apps_websockets_go_both_ways_with_the_subprotocol_it_chose(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    server = ws_app(app_root, sandbox)
    comm = ws_communicator(people["owner"], f"/sandboxes/{sandbox.pk}/app/api/kernels/k1/channels")

    async def run() -> tuple[Any, list[Any]]:
        connecting = asyncio.create_task(comm.connect(timeout=WAIT_S))
        agent = asyncio.create_task(play_agent(sent_tasks, app_root, connecting))
        connected = await connecting
        got = [await comm.receive_from(timeout=WAIT_S)]
        await comm.send_to(text_data='{"msg_type": "execute_request"}')
        got.append(await comm.receive_from(timeout=WAIT_S))
        await comm.send_to(bytes_data=b"\x00\x01" * 40_000)  # larger than one relayed piece
        got.append(await comm.receive_output(timeout=WAIT_S))
        await comm.disconnect()
        agent.cancel()
        return connected, got

    try:
        connected, got = asyncio.run(run())
    finally:
        server.shutdown()
    assert connected == (True, "v1.kernel.websocket.jupyter.org")
    assert got[0] == "hello over v1.kernel.websocket.jupyter.org"
    assert got[1] == '{"msg_type": "execute_request"}'
    assert got[2]["bytes"] == b"\x00\x01" * 40_000


def test_another_user_cannot_open_the_apps_websocket(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    comm = ws_communicator(people["member"], f"/sandboxes/{sandbox.pk}/app/api/events/subscribe")
    connected, code = asyncio.run(comm.connect(timeout=WAIT_S))
    assert (connected, code) == (False, 4403)
    assert not [t for t in sent_tasks if t[1] == "open_app"]
