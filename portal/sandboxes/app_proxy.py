"""A sandbox's web app (JupyterLab...) through the portal: ``/sandboxes/<id>/app/...``.

The sandbox has no network; its app listens on a unix socket the host agent reaches
(workers/drivers/app_socket.py). Each HTTP request here opens one connection through the
agent, relayed through Redis like a terminal's pty (workers/terminal_relay.py):
this consumer writes the request as HTTP/1.1 with h11 (``Connection: close``), reads the
response the same way and streams it to the browser.

Who may open it: the sandbox's **owner** only, not its project's managers or admins as the
terminal allows. The app is served on the portal's own origin, so its pages' scripts run
with the viewer's portal session; an app is its owner's code, and must never run with
someone else's. The portal's own cookies (session, CSRF) are taken out of what the app is
sent, and it may not set them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
from channels.db import database_sync_to_async
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from portal.sandboxes.consumers import TERMINAL_ISOLATION
from portal.sandboxes.models import Sandbox, SandboxState
from portal.sandboxes.tunnel import OPEN_TIMEOUT_S, Tunnel, TunnelClosed, TunnelSilent
from workers.drivers.app_socket import NOT_LISTENING
from workers.terminal_relay import StreamBroken

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 120.0  # between two pieces of the app's answer
# Hop-by-hop headers (RFC 9110 section 7.6.1), which stop at each hop.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                         b"transfer-encoding", b"upgrade"})  # fmt: skip


def app_url(sandbox_id: int) -> str:
    """The path the app is served under (its base URL, GPUSHARE_APP_URL in the sandbox)."""
    return f"/sandboxes/{sandbox_id}/app/"


def portal_cookie_names() -> frozenset[bytes]:
    return frozenset({settings.SESSION_COOKIE_NAME.encode(), settings.CSRF_COOKIE_NAME.encode()})


def without_portal_cookies(header: bytes) -> bytes:
    """A Cookie header without the portal's session and CSRF cookies: the app never sees them."""
    names = portal_cookie_names()
    kept = [c for c in header.split(b";") if c.strip() and c.strip().split(b"=", 1)[0] not in names]
    return b";".join(kept).strip()


@dataclass(frozen=True)
class Target:
    host: str
    allocation_key: str
    handle: dict[str, Any] | None


def authorize(user: Any, sandbox_id: int, host: str) -> Target | tuple[int, str]:
    """Where the app is, or (HTTP status, why not). ``host``: the request's Host header, held
    to ALLOWED_HOSTS as Django holds its own pages' (this route does not pass through it)."""
    if not validate_host(split_domain_port(host)[0], settings.ALLOWED_HOSTS):
        return 400, "Bad Host header."
    sandbox = Sandbox.objects.select_related("host", "image").filter(pk=sandbox_id).first()
    if user is None or not user.is_authenticated:
        return 403, "Sign in to open a sandbox's app."
    if sandbox is None or sandbox.owner_id != user.pk:
        return 403, "Only the sandbox's owner can open its app."
    if not sandbox.image.app:
        return 404, f"The image {sandbox.image.name} serves no app."
    if sandbox.state != SandboxState.RUNNING or sandbox.host is None:
        return 409, f"The sandbox is {sandbox.get_state_display().lower()}, not running."
    if sandbox.isolation not in TERMINAL_ISOLATION or sandbox.host.simulated_sandboxes:
        return 409, "Only container and process sandboxes on a real host serve their app here."
    return Target(sandbox.host.name, sandbox.allocation_key, sandbox.handle)


class AppProxy(AsyncHttpConsumer):
    async def handle(self, body: bytes) -> None:
        sandbox_id = int(self.scope["url_route"]["kwargs"]["sandbox_id"])
        host = dict(self.scope["headers"]).get(b"host", b"").decode("latin-1")
        verdict = await database_sync_to_async(authorize)(self.scope.get("user"), sandbox_id, host)
        if not isinstance(verdict, Target):
            await self._refuse(*verdict)
            return
        tunnel = Tunnel()
        try:
            await tunnel.open(verdict.host, "open_app", verdict.allocation_key, verdict.handle)
            await self._relay(tunnel, body)
        finally:
            await tunnel.close()

    async def _relay(self, tunnel: Tunnel, body: bytes) -> None:
        try:
            await tunnel.wait_opened(OPEN_TIMEOUT_S)
        except TunnelSilent:
            log.warning(
                "sandbox app %s: host %s did not open the app's connection in %.0f s",
                tunnel.session[:8], self.scope["path"][:200], OPEN_TIMEOUT_S,
            )  # fmt: skip
            await self._refuse(504, "The sandbox's host did not answer.")
            return
        except TunnelClosed as closed:
            if NOT_LISTENING in closed.reason:  # just started: its app has not opened its socket yet
                await self._starting()
            else:
                await self._refuse(502, f"The sandbox's app cannot be reached: {closed.reason}")
            return
        client = h11.Connection(h11.CLIENT)
        request = client.send(
            h11.Request(method=self.scope["method"], target=self._target(), headers=self._headers(body))
        )
        request += client.send(h11.Data(data=body)) if body else b""
        request += client.send(h11.EndOfMessage())
        await tunnel.write(request)
        started = False
        try:
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    try:
                        client.receive_data(await tunnel.read(ANSWER_TIMEOUT_S))
                    except TunnelClosed as closed:
                        if not started:
                            await self._refuse(502, f"The sandbox's app gave no answer ({closed.reason}).")
                            return
                        if isinstance(closed, TunnelSilent):
                            raise
                        client.receive_data(b"")  # it closed: h11 says whether the answer was whole
                elif isinstance(event, h11.Response):
                    started = True
                    await self.send_headers(
                        status=event.status_code, headers=self._answer_headers(event.headers)
                    )
                elif isinstance(event, h11.Data):
                    await self.send_body(bytes(event.data), more_body=True)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    await self.send_body(b"", more_body=False)
                    return
                # h11.InformationalResponse (100 Continue and the like): for this hop only
        except (TunnelSilent, StreamBroken, h11.RemoteProtocolError) as exc:
            if not started:
                await self._refuse(502, f"The sandbox's app gave no answer that could be read ({exc}).")
                return
            # Half an answer is out: ending it as if whole would hand the browser a truncated
            # file it might cache. Returning without the last body message makes the server
            # drop the connection, which the browser reports as a failed load.
            log.warning(
                "sandbox app %s: the answer to %s broke off: %s",
                tunnel.session[:8],
                self._target()[:200],
                exc,
            )

    def _target(self) -> bytes:
        path: bytes = self.scope.get("raw_path") or self.scope["path"].encode()
        query: bytes = self.scope.get("query_string", b"")
        return path + (b"?" + query if query else b"")

    def _headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        headers = []
        for name, value in self.scope["headers"]:
            name = name.lower()
            if name in _HOP_BY_HOP or name == b"content-length":  # set below, for the body sent
                continue
            if name == b"cookie":
                value = without_portal_cookies(value)
                if not value:
                    continue
            headers.append((name, value))
        client = self.scope.get("client") or ("", 0)
        headers += [
            (b"connection", b"close"),
            (b"content-length", str(len(body)).encode()),
            (b"x-forwarded-for", str(client[0]).encode()),
            (b"x-forwarded-proto", str(self.scope.get("scheme", "http")).encode()),
        ]
        return headers

    @staticmethod
    def _answer_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        portal_cookies = portal_cookie_names()
        kept = []
        for name, value in headers:
            if name.lower() in _HOP_BY_HOP:
                continue
            if name.lower() == b"set-cookie" and value.split(b"=", 1)[0].strip() in portal_cookies:
                continue  # the app may not sign the browser in or out of the portal
            kept.append((name, value))
        return kept

    async def _starting(self) -> None:
        """A page that says so and tries again by itself (the Refresh header), as a 503."""
        page = (
            "<!doctype html><html lang=en><head><meta charset=utf-8><title>Starting…</title></head>"
            "<body><p>The sandbox's app is starting: this page tries again every 2 seconds.</p></body></html>"
        )
        await self.send_response(
            503,
            page.encode(),
            headers=[
                (b"content-type", b"text/html; charset=utf-8"),
                (b"refresh", b"2"),
                (b"retry-after", b"2"),
                (b"cache-control", b"no-store"),
            ],
        )

    async def _refuse(self, status: int, reason: str) -> None:
        await self.send_response(
            status, reason.encode(), headers=[(b"content-type", b"text/plain; charset=utf-8")]
        )
