"""The portal's end of a stream a host agent relays: a terminal's pty, an SSH connection to a
sandbox's sshd, or one connection to a sandbox's web app (the protocol, over two Redis
streams: ``wire/relay.py``).

One class for the consumers that hold one (the web terminal, SSH, the app's HTTP proxy and
its WebSockets), so that each reads pieces in order and acknowledges them the same way: the
acknowledgement is what lets the agent send more (flow control). A read may be cancelled
(a request ends, a browser goes) without losing what it was waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, Self

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from redis.asyncio import Redis
from redis.exceptions import RedisError

from portal.accounts.streams import open_streams
from wire.messages import to_host
from wire.relay import Inbox, InOrder, in_stream, kind, out_stream, post, text
from wire.spec import HandleJson

# The agent opens the stream: a Celery message, then a thread. 10 s was not enough for a
# JupyterLab page's first burst of requests on a loaded two-core CI machine.
OPEN_TIMEOUT_S = 30.0


class TunnelClosed(Exception):
    """The stream ended, or never opened; ``reason`` says why, as the agent put it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TunnelSilent(TunnelClosed):
    """Nothing came in the time given: the agent, or what it relays, is stuck or gone."""


class Tunnel:
    def __init__(self) -> None:
        self.session = uuid.uuid4().hex  # unguessable: whoever knows it can write to the stream
        self.host = ""  # the host whose agent serves it (``open``): the streams are named by it
        self._redis: Redis | None = None
        self._inbox: Inbox | None = None
        self._order = InOrder()
        self._acked = 0
        self._agent_done = False  # it said "closed": nothing to tell it at close

    async def open(
        self,
        host: str,
        task: Literal["open_terminal", "open_app", "open_ssh"],
        allocation_key: str,
        handle: HandleJson | None,
        authorized_keys: list[str] | None = None,
    ) -> None:
        """Ask ``host``'s agent to open the stream (its Celery task ``task``; ``open_ssh``
        takes the keys its sshd lets in)."""
        self.host = host
        self._redis = Redis.from_url(settings.REDIS_URL)
        self._inbox = Inbox(self._redis, out_stream(host, self.session))
        agent = to_host(host)
        if task == "open_ssh":
            keys = authorized_keys or []
            await asyncio.to_thread(agent.open_ssh, self.session, allocation_key, handle, keys)
            return
        opener = agent.open_terminal if task == "open_terminal" else agent.open_app
        await asyncio.to_thread(opener, self.session, allocation_key, handle)

    async def wait_opened(self, timeout_s: float) -> None:
        entry = await self._next(timeout_s, "the sandbox's host did not answer")
        if kind(entry) != "opened":
            raise TunnelClosed(text(entry, "reason"))

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The next piece. TunnelClosed when the stream ended (TunnelSilent: nothing came
        for ``timeout_s``); ``relay.StreamBroken`` when a piece was lost.

        Asking for the next piece acknowledges the one before (it has been passed on), and
        nothing is awaited once a piece is taken: a read cancelled at any point loses none."""
        if self._acked < self._order.taken:
            await self._post(type="ack", seq=self._order.taken)  # sent twice if cancelled: harmless
            self._acked = self._order.taken
        entry = await self._next(timeout_s, f"nothing came for {timeout_s} s")
        if kind(entry) != "output":
            raise TunnelClosed(text(entry, "reason") or "the stream ended")
        return self._order.take(entry)

    async def write(self, data: bytes) -> None:
        await self._post(type="input", data=data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._post(type="resize", rows=rows, cols=cols)

    async def close(self) -> None:
        """Tell the agent to end the stream; idempotent."""
        if self._redis is None:
            return
        redis, self._redis = self._redis, None
        try:
            if not self._agent_done:
                await post(redis, in_stream(self.host, self.session), type="close")
            await redis.delete(out_stream(self.host, self.session))
        except RedisError:
            pass  # gone with Redis: the agent's side ends without input
        finally:
            await redis.aclose()

    async def _post(self, **fields: str | bytes | int) -> None:
        if self._redis is None:
            raise TunnelClosed("the tunnel is closed")
        try:
            await post(self._redis, in_stream(self.host, self.session), **fields)
        except RedisError as exc:
            raise TunnelClosed(f"the relay's Redis failed ({exc})") from exc

    async def _next(self, timeout_s: float | None, silence: str) -> dict[str, bytes]:
        if self._inbox is None:
            raise TunnelClosed("the tunnel is not open")
        try:
            entry = await self._inbox.next(timeout_s)
        except RedisError as exc:
            raise TunnelClosed(f"the relay's Redis failed ({exc})") from exc
        if entry is None:
            raise TunnelSilent(silence)
        self._agent_done = kind(entry) == "closed"
        return entry


class TunnelWebSocket(AsyncWebsocketConsumer):
    """A browser's WebSocket with a relayed stream behind it (the web terminal, an app's
    WebSockets): the tunnel, the task that passes what comes through it to the browser, and
    the recheck of the user's right while it is open (``still_allowed_all``, asked by the
    process's ``OpenStreams``), all three ended when the browser goes."""

    _tunnel: Tunnel | None = None
    _pump: asyncio.Task[None] | None = None

    def stream(self, pump: Coroutine[Any, Any, None], revoked: Callable[[], Awaitable[None]]) -> None:
        self._pump = asyncio.create_task(pump)
        open_streams().watch(self, revoked)

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        raise NotImplementedError

    async def disconnect(self, code: int) -> None:
        open_streams().forget(self)
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        if self._tunnel is not None:
            await self._tunnel.close()
