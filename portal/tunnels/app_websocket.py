"""A sandbox's web app's WebSockets (Jupyter's kernels, terminals, events) on its own origin.

The same way as its HTTP requests (``portal/tunnels/app_proxy.py``): the owner's app
session only, from a page of the app's own origin (the Origin header, exactly), one
connection to the app's socket through the host agent, relayed through Redis. The app's
handshake comes first, spoken with ``websockets``' sans-I/O client over that relay, so that
the browser is accepted with the subprotocol the app chose (Jupyter's kernel protocol
depends on it); then frames go both ways, whole messages to the browser. While it is open,
the app session, the portal session behind it and the owner's right are checked again every
``STREAM_RECHECK_S``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from channels.db import database_sync_to_async
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from portal.tunnels import app_access
from portal.tunnels.app_access import Refusal
from portal.tunnels.app_origin import AppLabel
from portal.tunnels.app_proxy import app_cookie, request_headers, token_header, without_reserved_cookies
from portal.tunnels.tunnel import OPEN_TIMEOUT_S, Tunnel, TunnelClosed, TunnelWebSocket
from wire.relay import StreamBroken

REFUSED, GONE = 4403, 1011  # not allowed; the app went away
MAX_MESSAGE = 64 * 1024 * 1024  # a notebook's outputs (images) come in one message


class AppWebSocket(TunnelWebSocket):
    _app: ClientProtocol | None = None
    _partial: tuple[Opcode, list[bytes]] | None = None

    _label: AppLabel | None = None
    _cookie = ""

    async def connect(self) -> None:
        apps = app_access.apps_domain()
        headers = request_headers(self.scope)
        host = headers.get(b"host", b"").decode("latin-1")
        label = apps.label(host) if apps is not None else None
        origin = headers.get(b"origin", b"").decode("latin-1").lower()
        if apps is None or label is None or origin != apps.origin(label.sandbox_id, label.allocation_key):
            await self.close(code=REFUSED)  # before accept(): the handshake is refused (403)
            return
        self._label, self._cookie = label, app_cookie(headers)
        verdict = await database_sync_to_async(app_access.admit)(self._cookie, label)
        if verdict is None or isinstance(verdict, Refusal):
            await self.close(code=REFUSED)
            return
        target, session = verdict
        # What the recheck reads (streams.current_user): the portal session behind the app's.
        self.scope["user"] = session.user
        self.scope["session"] = await database_sync_to_async(app_access.session_store)(session.session_key)
        self._tunnel = Tunnel()
        await self._tunnel.open(target.host, "open_app", target.allocation_key, target.handle)
        try:
            early = await self._handshake(self._tunnel, host, headers, token_header(target))
        except (TunnelClosed, StreamBroken):
            early = None
        if early is None:
            await self.close(code=REFUSED)
            return
        await self.accept(subprotocol=self._app.subprotocol if self._app else None)
        for frame in early:
            await self._to_browser(frame)
        self.stream(self._from_app(), self._revoked)

    async def _handshake(
        self, tunnel: Tunnel, host: str, headers: dict[bytes, bytes], token: bytes
    ) -> list[Frame] | None:
        """The app's answer to the browser's upgrade, asked over the agent's connection; the
        frames that came with it, or None when the app refused. TunnelClosed when it was
        not there."""
        await tunnel.wait_opened(OPEN_TIMEOUT_S)
        query = self.scope.get("query_string", b"").decode("latin-1")
        path = self.scope["path"] + (f"?{query}" if query else "")
        offered = [Subprotocol(p) for p in self.scope.get("subprotocols") or []]  # ASGI's own list
        self._app = ClientProtocol(
            parse_uri(f"ws://{host}{path}"), subprotocols=offered or None, max_size=MAX_MESSAGE
        )
        request = self._app.connect()
        cookie = without_reserved_cookies(headers.get(b"cookie", b""))
        if cookie:
            request.headers["Cookie"] = cookie.decode("latin-1")
        request.headers["Authorization"] = headers.get(b"authorization", token).decode("latin-1")
        if b"origin" in headers:  # Jupyter compares it with Host, as a browser sent them
            request.headers["Origin"] = headers[b"origin"].decode("latin-1")
        self._app.send_request(request)
        await self._flush()
        while True:
            self._app.receive_data(await tunnel.read(OPEN_TIMEOUT_S))
            events = self._app.events_received()
            if events and isinstance(events[0], Response):
                if self._app.handshake_exc is not None:
                    return None
                return [e for e in events[1:] if isinstance(e, Frame)]

    async def _from_app(self) -> None:
        assert self._app is not None and self._tunnel is not None  # noqa: S101 - set by connect
        while True:
            try:
                data = await self._tunnel.read()
            except (TunnelClosed, StreamBroken):
                await self.close(code=GONE)
                return
            self._app.receive_data(data)
            for event in self._app.events_received():
                if isinstance(event, Frame):
                    await self._to_browser(event)
            await self._flush()  # the pongs to its pings

    async def _to_browser(self, frame: Frame) -> None:
        if frame.opcode == Opcode.CLOSE:
            await self.close()
            return
        if frame.opcode in (Opcode.PING, Opcode.PONG):
            return
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._partial = (frame.opcode, [frame.data])
        elif frame.opcode == Opcode.CONT and self._partial is not None:
            self._partial[1].append(frame.data)
        if not frame.fin or self._partial is None:
            return
        opcode, parts = self._partial
        self._partial = None
        if opcode == Opcode.TEXT:
            await self.send(text_data=b"".join(parts).decode())
        else:
            await self.send(bytes_data=b"".join(parts))

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self._app is None:
            return
        if text_data is not None:
            self._app.send_text(text_data.encode())
        elif bytes_data is not None:
            self._app.send_binary(bytes_data)
        await self._flush()

    async def _flush(self) -> None:
        if self._app is None or self._tunnel is None:
            return
        data = b"".join(self._app.data_to_send())
        if data:
            await self._tunnel.write(data)

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        """One app session at a time (its record is in the cache, its owner's sandbox
        queried): an owner's open app sockets are few, the sample streams many."""
        return [socket._still_allowed(user) for socket, user in asks]

    def _still_allowed(self, user: Any) -> bool:
        assert self._label is not None  # noqa: S101 - set by connect
        verdict = app_access.admit(self._cookie, self._label)
        return isinstance(verdict, tuple) and verdict[1].user.pk == user.pk

    async def _revoked(self) -> None:
        await self.close(code=REFUSED)
