"""A sandbox's web app on its own origin, end to end in one process: the ASGI application
(the Host decides), the proxy's HTTP and WebSocket consumers, the Redis relay, and the
agent's side (``relay_stream`` with the drivers' unix-socket connection) to a real HTTP
server on a unix socket. Grants and app sessions: test_app_origin.py. The real sandboxes
(JupyterLab in a container, a hostile app, in Chromium) have their own tests."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.conf import settings
from django.test import override_settings

from portal.asgi import application
from portal.sandboxes import reach
from portal.sandboxes.models import Sandbox
from portal.tunnels import app_access
from portal.tunnels.app_origin import AppLabel, AppsDomain
from tests.factories import ImageFactory
from tests.portal.helpers import client_for
from tests.portal.tunnels.test_terminal import WAIT_S, running_sandbox
from wire.spec import SandboxHandle
from workers.drivers import app_socket
from workers.host.terminals import relay_stream

pytestmark = pytest.mark.django_db(transaction=True)  # the consumer reads in its own thread
BIG = 3 * 1024 * 1024


class App(BaseHTTPRequestHandler):
    """What an app in a sandbox would answer: what it was asked, and headers that would reach
    past its origin (a service worker's scope, cookies for the portal and its parent domain,
    Clear-Site-Data)."""

    def do_GET(self) -> None:
        if self.path.endswith("/big"):
            self._answer(b"x" * BIG)
            return
        seen = {
            "path": self.path,
            "cookie": self.headers.get("cookie", ""),
            "host": self.headers.get("host"),
            "authorization": self.headers.get("authorization", ""),
        }
        self._answer(json.dumps(seen).encode(), cookies=PLANTED, extra=HOSTILE)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self._answer(b"got " + body)

    def _answer(
        self, body: bytes, cookies: tuple[str, ...] = (), extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        for cookie in cookies:
            self.send_header("set-cookie", cookie)
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


PLANTED = (
    "sessionid=planted; Path=/",
    "__Host-sessionid=planted; Path=/; Secure",
    f"{settings.DEVICE_COOKIE_NAME}=planted; Path=/",
    "gpushare_app=planted; Path=/",
    "wide=1; Domain=gpus.test; Path=/",
    "_xsrf=abc; Path=/",
)
HOSTILE = (
    ("Service-Worker-Allowed", "/"),
    ("Clear-Site-Data", '"cookies", "storage"'),
    ("Strict-Transport-Security", "max-age=1"),
    ("X-Kept", "yes"),
)


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


APPS = AppsDomain.parse("apps.gpus.test", "http://gpus.test")


@pytest.fixture(autouse=True)
def _apps_on_their_own_origins() -> Iterator[None]:
    with override_settings(APPS=APPS, PORTAL_URL="http://gpus.test"):
        yield


def app_host(sandbox: Sandbox) -> bytes:
    """The Host header of the sandbox's app origin."""
    assert APPS is not None
    return APPS.origin(sandbox.pk, sandbox.allocation_key).removeprefix("http://").encode()


def app_session_for(user: Any, sandbox: Sandbox) -> str:
    """The owner's app session cookie, as a grant redeemed on the app's origin makes it."""
    session = client_for(user).session.session_key or ""
    target = app_access.Target(sandbox.host.name, sandbox.allocation_key, sandbox.handle)  # type: ignore[union-attr]
    url = app_access.issue_grant(user, session, target, sandbox.pk, "/")
    code = parse_qs(urlsplit(url).query)["code"][0]
    value = app_access.redeem_grant(code, AppLabel(sandbox.pk, sandbox.allocation_key))
    assert value is not None
    return value


def fetch(
    user: Any,
    sandbox: Sandbox,
    path: str,
    method: str = "GET",
    body: bytes = b"",
    root: Path | None = None,
    sent: Any = None,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> dict[str, Any]:
    """The app origin's answer to ``user``'s request, the agent's part played by
    ``relay_stream`` on the host's side of ``root`` (when the proxy asks for a connection)."""
    return fetch_all(user, sandbox, [(path, method, body)], root, sent, extra)[0]


def fetch_all(
    user: Any,
    sandbox: Sandbox,
    requests: list[tuple[str, str, bytes]],
    root: Path | None = None,
    sent: Any = None,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> list[dict[str, Any]]:
    """Several requests in one event loop: the channel layer's locks belong to the loop that
    made them, so a second ``asyncio.run`` would meet the first one's. The browser sends the
    app session, and (were they sent, as a same-site portal's might be) the portal's cookies."""
    portal_session = client_for(user).cookies[settings.SESSION_COOKIE_NAME].value
    cookie = (
        f"{settings.SESSION_COOKIE_NAME}={portal_session}; {settings.DEVICE_COOKIE_NAME}=d1; _xsrf=abc; "
        f"{app_access.cookie_name()}={app_session_for(user, sandbox)}"
    ).encode()

    async def one(path: str, method: str, body: bytes) -> dict[str, Any]:
        headers = [(b"host", app_host(sandbox)), (b"cookie", cookie), *(extra or [])]
        comm = HttpCommunicator(application, method, path, body=body, headers=headers)
        answer = asyncio.create_task(comm.get_response(timeout=WAIT_S))
        deadline = time.monotonic() + WAIT_S
        while not answer.done() and time.monotonic() < deadline:
            asked = [t for t in (sent or []) if t[1] == "open_app"]
            if asked and root is not None:
                sent.remove(asked[0])
                queue, _, (session, key, _handle) = asked[0]
                handle = SandboxHandle("process", key, 0, "pid")
                opener = functools.partial(lambda folder, k, _h: app_socket.connect(folder, k), root, key)
                relay_stream(opener, queue.removeprefix("host."), session, key, handle, 30, "app")
            await asyncio.sleep(0.02)
        return await answer

    async def run() -> list[dict[str, Any]]:
        return [await one(*request) for request in requests]

    return asyncio.run(run())


def headers(answer: dict[str, Any], name: bytes) -> list[bytes]:
    return [v for k, v in answer["headers"] if k.lower() == name]


def test_the_owner_reaches_the_app_and_nothing_crosses_its_origin(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    server = serve_app(app_root, sandbox)
    try:
        answer, big, posted = fetch_all(
            people["owner"],
            sandbox,
            [("/lab?reset=1", "GET", b""), ("/big", "GET", b""), ("/api", "POST", b'{"cell": 1}')],
            app_root,
            sent_tasks,
        )
        assert answer["status"] == 200, answer
        seen = json.loads(answer["body"])
        assert seen["path"] == "/lab?reset=1" and seen["host"] == app_host(sandbox).decode()
        # Neither the portal's cookies nor the app session reach the app; its own token does.
        assert seen["cookie"] == "_xsrf=abc"
        assert seen["authorization"] == f"token {reach.app_token(sandbox.allocation_key)}"
        # It may not set the portal's cookies or the app session, nor one for a parent domain.
        assert headers(answer, b"set-cookie") == [b"wide=1; Path=/", b"_xsrf=abc; Path=/"]
        assert headers(answer, b"service-worker-allowed") == headers(answer, b"clear-site-data") == []
        assert headers(answer, b"strict-transport-security") == []
        assert headers(answer, b"x-kept") == [b"yes"]

        assert big["status"] == 200 and big["body"] == b"x" * BIG
        assert posted["body"] == b'got {"cell": 1}'
    finally:
        server.shutdown()
        server.server_close()


def test_an_app_not_listening_yet_is_a_page_that_tries_again(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    answer = fetch(people["owner"], sandbox, "/lab", root=app_root, sent=sent_tasks)
    assert answer["status"] == 503 and b"is starting" in answer["body"]
    assert b"its app is not listening on /run/gpushare/app.sock" in answer["body"]
    assert headers(answer, b"refresh") == [b"2"]


def test_an_app_socket_planted_as_a_link_to_a_root_only_socket_reaches_nothing(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    """The review's probe, end to end through the proxy: ``app.sock`` a symlink to a 0600
    socket of root's on the host. The listener sees no connection; the owner is told the
    app is not listening, and why. (The drivers' own tests plant it from inside real process
    and Docker sandboxes: tests/workers/test_app_socket_paths.py.)"""
    sandbox = with_app(running_sandbox(people, catalog))
    private = app_root / "root-only"
    private.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(private / "probe.sock"))
    (private / "probe.sock").chmod(0o600)
    listener.listen(1)
    listener.setblocking(False)
    folder = app_root / sandbox.allocation_key
    folder.mkdir()
    (folder / "app.sock").symlink_to(private / "probe.sock")
    try:
        answer = fetch(people["owner"], sandbox, "/lab", root=app_root, sent=sent_tasks)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    finally:
        listener.close()
    assert answer["status"] == 503 and b"its app is not listening" in answer["body"]
    assert b"app.sock is a symlink, not a socket" in answer["body"], answer["body"]


@pytest.mark.parametrize(
    ("extra", "method", "says"),
    [
        # Another site's script (another sandbox's app, same site under APPS_DOMAIN) fetching it.
        ([(b"sec-fetch-site", b"same-site"), (b"sec-fetch-mode", b"cors")], "GET", b"another site's page"),
        ([(b"sec-fetch-site", b"cross-site"), (b"sec-fetch-mode", b"no-cors")], "GET", b"another site"),
        # A form another site's page posts, as a top-level navigation.
        ([(b"sec-fetch-site", b"same-site"), (b"sec-fetch-mode", b"navigate")], "POST", b"another site"),
        # Framed by another site.
        (
            [
                (b"sec-fetch-site", b"cross-site"),
                (b"sec-fetch-mode", b"navigate"),
                (b"sec-fetch-dest", b"iframe"),
            ],
            "GET",
            b"another site",
        ),
        # A browser without Fetch Metadata: the Origin of a change.
        ([(b"origin", b"http://7-" + b"0" * 32 + b".apps.gpus.test")], "POST", b"changes that another site"),
    ],
)
def test_what_another_sites_page_asks_of_the_app_is_refused_before_it(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    extra: list[tuple[bytes, bytes]],
    method: str,
    says: bytes,
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    answer = fetch(people["owner"], sandbox, "/api/kernels", method, b"{}", extra=extra)
    assert answer["status"] == 403 and says in answer["body"], answer
    assert not [t for t in sent_tasks if t[1] == "open_app"]  # the host was never asked


@pytest.mark.parametrize(
    ("persona", "change", "status", "says"),
    [
        ("outsider", "", 404, b"Not Found"),  # not theirs to see: no hint it exists
        ("member", "", 403, b"Only the sandbox&#x27;s owner"),
        ("admin", "", 403, b"Only the sandbox&#x27;s owner"),  # the app's scripts would run as the admin
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
    """The portal's *Open* link grants the owner alone, and only while the app can answer."""
    sandbox = running_sandbox(people, catalog)
    if change != "no app":
        with_app(sandbox)
    if change == "stopped":
        Sandbox.objects.filter(pk=sandbox.pk).update(state="stopped")
    answer = client_for(people[persona]).get(f"/sandboxes/{sandbox.pk}/app/lab")
    assert answer.status_code == status and says in answer.content
    assert not [t for t in sent_tasks if t[1] == "open_app"]  # the host was never asked


def ws_app(root: Path, sandbox: Sandbox) -> Any:
    """An app's WebSocket on its socket: echoes each message, and says which subprotocol it
    took and which token it was sent."""
    from websockets.sync.server import unix_serve

    def echo(connection: Any) -> None:
        token = connection.request.headers.get("Authorization", "")
        connection.send(f"hello over {connection.subprotocol} with {token[:6]}")
        for message in connection:
            connection.send(message)

    folder = root / sandbox.allocation_key
    folder.mkdir(parents=True)
    server = unix_serve(echo, str(folder / "app.sock"), subprotocols=["v1.kernel.websocket.jupyter.org"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def ws_communicator(
    user: Any, sandbox: Sandbox, path: str, origin: bytes | None = None
) -> WebsocketCommunicator:
    own = b"http://" + app_host(sandbox)
    cookie = f"{app_access.cookie_name()}={app_session_for(user, sandbox)}; _xsrf=abc".encode()
    return WebsocketCommunicator(
        application,
        path,
        headers=[(b"host", app_host(sandbox)), (b"origin", origin or own), (b"cookie", cookie)],
        subprotocols=["v1.kernel.websocket.jupyter.org"],
    )


async def play_agent(sent: list[Any], root: Path, until: asyncio.Task[Any]) -> None:
    """The host agent's part: each ``open_app`` the portal sends, relayed to ``root``'s socket."""
    deadline = time.monotonic() + WAIT_S
    while not until.done() and time.monotonic() < deadline:
        for asked in [t for t in sent if t[1] == "open_app"]:
            sent.remove(asked)
            queue, _, (session, key, _handle) = asked
            opener = functools.partial(lambda folder, k, _h: app_socket.connect(folder, k), root, key)
            relay_stream(
                opener,
                queue.removeprefix("host."),
                session,
                key,
                SandboxHandle("process", key, 0, "pid"),
                30,
                "app",
            )
        await asyncio.sleep(0.02)


def test_the_apps_websockets_go_both_ways_with_the_subprotocol_it_chose(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, app_root: Path
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    server = ws_app(app_root, sandbox)
    comm = ws_communicator(people["owner"], sandbox, "/api/kernels/k1/channels")

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
    assert got[0] == "hello over v1.kernel.websocket.jupyter.org with token "
    assert got[1] == '{"msg_type": "execute_request"}'
    assert got[2]["bytes"] == b"\x00\x01" * 40_000


@pytest.mark.parametrize("who", ["member", "another origin", "portal origin"])
def test_only_the_owners_pages_on_the_apps_origin_open_its_websockets(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, who: str
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    path = "/api/events/subscribe"
    if who == "member":
        comm = ws_communicator(people["member"], sandbox, path)
    else:
        origin = (
            b"http://gpus.test" if who == "portal origin" else b"http://9-" + b"0" * 32 + b".apps.gpus.test"
        )
        comm = ws_communicator(people["owner"], sandbox, path, origin=origin)
    connected, code = asyncio.run(comm.connect(timeout=WAIT_S))
    assert (connected, code) == (False, 4403)
    assert not [t for t in sent_tasks if t[1] == "open_app"]
