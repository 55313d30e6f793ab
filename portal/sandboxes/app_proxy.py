"""A sandbox's web app (JupyterLab...) on its own origin: every HTTP request to
``<sandbox>-<key>.<APPS_DOMAIN>`` (``portal.asgi`` sends them here, never to Django).

The sandbox has no network; its app listens on a unix socket the host agent reaches
(workers/drivers/app_socket.py). Each HTTP request here opens one connection through the
agent, relayed through Redis like a terminal's pty (wire/relay.py): this
consumer writes the request as HTTP/1.1 with h11 (``Connection: close``), reads the response
the same way and streams it to the browser.

Who gets through: the owner's browser with a live app session (``app_access``), which
``GRANT_PATH`` makes from the portal's grant. What crosses, and what does not:
- to the app: the request, without the app session cookie or any of the portal's, and with
  ``Authorization: token <the app's own secret>`` unless the browser sent one (JupyterLab
  asks for it: a bare connection to its socket gets nothing);
- from the app: its answer, without what would reach past its origin: ``Set-Cookie`` for
  the portal's or the app session's names (dropped) or for a parent domain (the Domain
  attribute removed: the cookie stays host-only), ``Clear-Site-Data`` (it clears the whole
  site's cookies, the portal's included), ``Service-Worker-Allowed``, HSTS and ``Alt-Svc``;
- refused before the app sees it: another site's subresource requests and form posts
  (Fetch Metadata; the app's own XSRF checks are skipped for token-authenticated requests),
  and unsafe methods from another origin.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

import h11
from channels.db import database_sync_to_async
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings

from portal.sandboxes import app_access
from portal.sandboxes.app_access import Refusal, Target
from portal.sandboxes.app_origin import GRANT_PATH, AppLabel
from portal.sandboxes.tunnel import OPEN_TIMEOUT_S, Tunnel, TunnelClosed, TunnelSilent
from wire.relay import NOT_LISTENING, StreamBroken

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 120.0  # between two pieces of the app's answer
# Hop-by-hop headers (RFC 9110 section 7.6.1), which stop at each hop.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                         b"transfer-encoding", b"upgrade"})  # fmt: skip
# Answer headers that act beyond the app's own origin, or on its transport: never passed on.
_BEYOND_ORIGIN = frozenset({b"service-worker-allowed", b"clear-site-data", b"strict-transport-security",
                            b"alt-svc"})  # fmt: skip
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def reserved_cookie_names() -> frozenset[str]:
    """Cookies the app may neither read nor set: the app session's and the portal's (their
    plain and __Host- names alike, whatever this server's scheme)."""
    names = {
        settings.SESSION_COOKIE_NAME,
        settings.CSRF_COOKIE_NAME,
        settings.DEVICE_COOKIE_NAME,
        app_access.cookie_name(),
    }
    return frozenset(names | {n.removeprefix("__Host-") for n in names} | {f"__Host-{n}" for n in names})


def without_reserved_cookies(header: bytes) -> bytes:
    """A Cookie header without the app session's and the portal's cookies."""
    names = {n.encode() for n in reserved_cookie_names()}
    kept = [c for c in header.split(b";") if c.strip() and c.strip().split(b"=", 1)[0] not in names]
    return b";".join(kept).strip()


def request_headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (the last of repeated ones, but Cookie)."""
    found: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", []):
        name = name.lower()
        found[name] = found[name] + b"; " + value if name == b"cookie" and name in found else value
    return found


def app_cookie(headers: dict[bytes, bytes]) -> str:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(headers.get(b"cookie", b"").decode("latin-1"))
    except Exception:  # a malformed Cookie header is no app session
        return ""
    morsel = jar.get(app_access.cookie_name())
    return morsel.value if morsel is not None else ""


def cross_site_refusal(method: str, headers: dict[bytes, bytes], own_origin: str) -> str:
    """Why a request another site's page made is refused ('' when it is not): only a
    top-level navigation (a link, a redirect) may come from elsewhere. Fetch Metadata where
    the browser sends it; for unsafe methods the Origin as well."""
    site = headers.get(b"sec-fetch-site", b"").lower()
    if site in (b"cross-site", b"same-site"):
        navigation = headers.get(b"sec-fetch-mode", b"").lower() == b"navigate"
        document = headers.get(b"sec-fetch-dest", b"document").lower() == b"document"
        if not (navigation and document and method in ("GET", "HEAD")):
            return "This app does not answer requests that another site's page makes."
    origin = headers.get(b"origin")
    if method not in _SAFE_METHODS and origin is not None and origin.decode("latin-1").lower() != own_origin:
        return "This app does not answer changes that another site's page asks for."
    return ""


def token_header(target: Target) -> bytes:
    return f"token {app_access.app_token(target.allocation_key)}".encode()


def answer_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The app's answer headers a browser may have: see the module's docstring."""
    reserved = reserved_cookie_names()
    kept = []
    for name, value in headers:
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in _BEYOND_ORIGIN:
            continue
        if lower == b"set-cookie":
            value = host_only_cookie(value, reserved)
            if not value:
                continue
        kept.append((name, value))
    return kept


def host_only_cookie(value: bytes, reserved: frozenset[str]) -> bytes:
    """A Set-Cookie value kept to the app's own host (no Domain attribute); b"" when it would
    set one of the reserved cookies."""
    pair, *attributes = value.split(b";")
    cookie_name = pair.split(b"=", 1)[0].strip().decode("latin-1")
    if cookie_name in reserved or cookie_name.removeprefix("__Secure-") in reserved:
        return b""
    kept = [a for a in attributes if a.strip().split(b"=", 1)[0].strip().lower() != b"domain"]
    return b";".join([pair, *kept])


class AppProxy(AsyncHttpConsumer):
    async def handle(self, body: bytes) -> None:
        apps = app_access.apps_domain()
        headers = request_headers(self.scope)
        label = apps.label(headers.get(b"host", b"").decode("latin-1")) if apps is not None else None
        if apps is None or label is None:
            await self._refuse(404, "No sandbox's app is served at this address.")
            return
        if self.scope["path"] == GRANT_PATH:
            if self.scope["method"] != "GET":  # a navigation from the portal's redirect, only
                await self._refuse(405, "A grant is redeemed by GET, from the portal's redirect.")
                return
            await self._redeem(label)
            return
        own_origin = apps.origin(label.sandbox_id, label.allocation_key)
        if refusal := cross_site_refusal(self.scope["method"], headers, own_origin):
            await self._refuse(403, refusal)
            return
        verdict = await database_sync_to_async(app_access.admit)(app_cookie(headers), label)
        if verdict is None:
            await self._sign_in_again(label, headers)
            return
        if isinstance(verdict, Refusal):
            await self._refuse(verdict.status, verdict.reason)
            return
        target = verdict[0]
        tunnel = Tunnel()
        try:
            await tunnel.open(target.host, "open_app", target.allocation_key, target.handle)
            await self._relay(tunnel, body, target)
        finally:
            await tunnel.close()

    async def _redeem(self, label: AppLabel) -> None:
        """The portal's grant, redeemed once for an app session on this origin only."""
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        code, next_path = (query.get("code") or [""])[0], (query.get("next") or ["/"])[0]
        value = await database_sync_to_async(app_access.redeem_grant)(code, label) if code else None
        if value is None:
            back = f"{settings.PORTAL_URL}/sandboxes/{label.sandbox_id}/"
            await self._refuse(403, f"This link to the app was used or has expired: open it from {back}")
            return
        apps = app_access.apps_domain()
        cookie = (
            f"{app_access.cookie_name()}={value}; Path=/; HttpOnly; SameSite=Lax; "
            f"Max-Age={settings.APP_SESSION_TTL_S}{'; Secure' if apps is not None and apps.secure else ''}"
        )
        await self.send_response(
            303,
            b"",
            headers=[
                (b"location", app_access.safe_next(next_path).encode("latin-1")),
                (b"set-cookie", cookie.encode("latin-1")),
                (b"cache-control", b"no-store"),
                (b"referrer-policy", b"no-referrer"),
            ],
        )

    async def _sign_in_again(self, label: AppLabel, headers: dict[bytes, bytes]) -> None:
        """No live app session: a page load goes round the portal for a new grant (which
        signs in and checks the owner there); anything else is refused."""
        mode = headers.get(b"sec-fetch-mode", b"navigate").lower()
        if self.scope["method"] in ("GET", "HEAD") and mode == b"navigate":
            query = self.scope.get("query_string", b"").decode("latin-1")
            path = self.scope["path"] + (f"?{query}" if query else "")
            portal = f"{settings.PORTAL_URL}/sandboxes/{label.sandbox_id}/app{app_access.safe_next(path)}"
            await self.send_response(
                302, b"", headers=[(b"location", portal.encode("latin-1")), (b"cache-control", b"no-store")]
            )
            return
        await self._refuse(403, "No app session here: open the app from its sandbox's page in the portal.")

    async def _relay(self, tunnel: Tunnel, body: bytes, target: Target) -> None:
        try:
            await tunnel.wait_opened(OPEN_TIMEOUT_S)
        except TunnelSilent:
            log.warning(
                "sandbox app %s: host %s did not open the app's connection in %.0f s",
                tunnel.session[:8], target.host, OPEN_TIMEOUT_S,
            )  # fmt: skip
            await self._refuse(504, "The sandbox's host did not answer.")
            return
        except TunnelClosed as closed:
            if NOT_LISTENING in closed.reason:  # just started: its app has not opened its socket yet
                await self._starting(closed.reason[closed.reason.index(NOT_LISTENING) :])
            else:
                await self._refuse(502, f"The sandbox's app cannot be reached: {closed.reason}")
            return
        client = h11.Connection(h11.CLIENT)
        request = client.send(
            h11.Request(
                method=self.scope["method"], target=self._target(), headers=self._headers(body, target)
            )
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
                    await self.send_headers(status=event.status_code, headers=answer_headers(event.headers))
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

    def _headers(self, body: bytes, target: Target) -> list[tuple[bytes, bytes]]:
        headers = []
        for name, value in self.scope["headers"]:
            name = name.lower()
            if name in _HOP_BY_HOP or name == b"content-length":  # set below, for the body sent
                continue
            if name == b"cookie":
                value = without_reserved_cookies(value)
                if not value:
                    continue
            headers.append((name, value))
        if not any(name == b"authorization" for name, _ in headers):
            headers.append((b"authorization", token_header(target)))
        client = self.scope.get("client") or ("", 0)
        headers += [
            (b"connection", b"close"),
            (b"content-length", str(len(body)).encode()),
            (b"x-forwarded-for", str(client[0]).encode()),
            (b"x-forwarded-proto", str(self.scope.get("scheme", "http")).encode()),
        ]
        return headers

    async def _starting(self, why: str) -> None:
        """A page that says so, with what the host found (no socket yet; or a link, a FIFO,
        someone else's socket where its socket goes, which the agent never follows), and
        tries again by itself (the Refresh header), as a 503."""
        page = (
            "<!doctype html><html lang=en><head><meta charset=utf-8><title>Starting…</title></head>"
            "<body><p>The sandbox's app is starting: this page tries again every 2 seconds.</p>"
            f"<p><small>The host says: {html.escape(why)}.</small></p></body></html>"
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
            status,
            reason.encode(),
            headers=[(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")],
        )
