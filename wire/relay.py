"""Web terminals and web apps: a sandbox's pty or app connection relayed between its host
agent and the portal.

The portal never reaches a GPU host directly (docs/architecture.md: agents only share the
broker and Redis). The portal's end (``portal/tunnels/tunnel.py``) mints a session id
nobody else knows and asks the sandbox's agent, through its Celery queue, to open the
stream (``open_terminal``, ``open_app``). The agent opens it (the driver's
``exec_terminal`` or ``open_app``) and relays, through two Redis streams named after the
session:

- ``<session>:out``, agent -> portal: ``opened``, the stream's ``output`` (numbered by
  ``seq`` from 1), and last ``closed`` with the reason;
- ``<session>:in``, portal -> agent: ``input``, ``resize``, ``ack`` and ``close``;

until the stream ends, the portal goes away (``close``) or nothing comes in for
``idle_s``. Nothing here touches the database.

**Why Redis streams, not the channel layer.** The channel layer loses messages: what
waits past its expiry or beyond a channel's capacity, and, in a process where many
consumers come and go, the one a receive was holding when it was cancelled (every proxied
request ends by cancelling one). A stream keeps each entry until its reader has read it;
a read cancelled halfway is read again. The reader trims what it has read.

**Flow control.** The agent has at most ``WINDOW`` pieces out that the portal has not
acknowledged (``ack`` with the highest ``seq`` it took), and stops reading the stream
until it has: a fast app waits for a slow browser instead of filling Redis. The numbers
let the reader notice a piece missing all the same (``StreamBroken``) and end the stream
rather than pass on a corrupt one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any, Protocol

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 0.2
# Pieces out and not acknowledged. A piece is at most a read's worth (a pty's, or an app
# socket's READ_SIZE): 8 keep a local relay's pipe full without holding megabytes in Redis.
WINDOW = 8
# A stream nobody writes to for this long goes: what a side that died left, or the close
# a portal sends after the agent has gone. An idle stream that goes comes back at the next
# entry (its ids grow with time, so its reader's place holds).
KEY_TTL_S = 600
_PREFIX = "gpushare:relay:"
# What an agent says when a sandbox's app has not opened its socket: the portal tells an app
# still starting from the other refusals by it.
NOT_LISTENING = "its app is not listening"


class Terminal(Protocol):
    """An interactive pty into a sandbox, for the portal's web terminal."""

    def write(self, data: bytes) -> None: ...

    def read(self, timeout_s: float = 0.1) -> bytes: ...

    def resize(self, rows: int, cols: int) -> None: ...

    def close(self) -> None: ...


# Named by the host that serves the session: its agent's Redis user may touch only its own
# (``wire.broker_acl``), so no other host can read or feed another host's terminals.
def out_stream(host: str, session: str) -> str:
    return f"{_PREFIX}{host}:{session}:out"


def in_stream(host: str, session: str) -> str:
    return f"{_PREFIX}{host}:{session}:in"


def host_pattern(host: str) -> str:
    """Every relay stream of ``host``, as an ACL key pattern (host names hold no glob characters)."""
    return f"{_PREFIX}{host}:*"


async def post(redis: Any, key: str, **fields: str | bytes | int) -> None:
    """Append one entry to a relay stream (``redis``: a ``redis.asyncio.Redis``)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xadd(key, fields)
        pipe.expire(key, KEY_TTL_S)
        await pipe.execute()


class Inbox:
    """One relay stream, read in order by its one reader, which trims what it has read."""

    def __init__(self, redis: Any, key: str) -> None:
        self.redis = redis
        self.key = key
        self._after = b"0-0"
        self._read: deque[dict[str, bytes]] = deque()

    async def next(self, timeout_s: float | None) -> dict[str, bytes] | None:
        """The next entry (field names as str), or None after ``timeout_s`` without one
        (None: wait as long as it takes)."""
        if not self._read:
            block = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
            answer = await self.redis.xread({self.key: self._after}, count=64, block=block)
            if not answer:
                return None
            entries = answer[0][1]
            # No await since the answer came: a cancellation lands before it or after this.
            self._after = entries[-1][0]
            self._read.extend({k.decode(): v for k, v in fields.items()} for _id, fields in entries)
            await self.redis.xtrim(self.key, minid=self._after)  # the entries before the last read
        return self._read.popleft()


def kind(entry: dict[str, bytes]) -> str:
    return entry.get("type", b"").decode()


def text(entry: dict[str, bytes], field: str) -> str:
    return entry.get(field, b"").decode("utf-8", "replace")


class StreamBroken(Exception):
    """A piece of a relayed stream is missing: what would follow it is corrupt."""


class InOrder:
    """The reading end's check that each ``output`` is the next piece."""

    def __init__(self) -> None:
        self.taken = 0  # the highest seq taken: what the reader acknowledges

    def take(self, entry: dict[str, bytes]) -> bytes:
        seq = int(entry.get("seq", b"0"))
        if seq != self.taken + 1:
            raise StreamBroken(f"piece {self.taken + 1} of the stream was lost (the next to come was {seq})")
        self.taken = seq
        return entry.get("data", b"")


class _Window:
    """The sending end's count of pieces out and acknowledged."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent = 0
        self.acked = 0
        self._moved = asyncio.Event()

    async def wait_for_room(self) -> None:
        while self.sent - self.acked >= self.size:
            self._moved.clear()
            await self._moved.wait()

    def acknowledge(self, seq: int) -> None:
        if self.acked < seq <= self.sent:
            self.acked = seq
            self._moved.set()


async def relay(
    redis: Any, terminal: Terminal, host: str, session: str, idle_s: float, window: int = WINDOW
) -> str:
    """Relay one session of ``host`` until it ends; returns why it ended (also sent as ``closed``)."""
    out = out_stream(host, session)
    inbox = Inbox(redis, in_stream(host, session))
    await post(redis, out, type="opened")
    pieces = _Window(window)

    async def pump_out() -> str:
        while True:
            await pieces.wait_for_room()
            try:
                data = await asyncio.to_thread(terminal.read, READ_TIMEOUT_S)
            except EOFError as exc:
                return str(exc) or "the shell exited"
            if data:
                pieces.sent += 1
                await post(redis, out, type="output", seq=pieces.sent, data=data)

    async def pump_in() -> str:
        while True:
            entry = await inbox.next(idle_s)
            if entry is None:
                return f"closed after {idle_s:.0f} s without input"
            what = kind(entry)
            if what == "close":
                return "closed by the browser"
            try:
                if what == "ack":
                    pieces.acknowledge(int(entry["seq"]))
                elif what == "input":
                    await asyncio.to_thread(terminal.write, entry.get("data", b""))
                elif what == "resize":
                    terminal.resize(int(entry["rows"]), int(entry["cols"]))
            except EOFError as exc:
                return str(exc) or "the shell exited"
            except (KeyError, ValueError) as exc:
                log.warning("relay %s: bad %r entry ignored (%s)", session[:8], what, exc)

    tasks = [asyncio.create_task(pump_out()), asyncio.create_task(pump_in())]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        reason = next(iter(done)).result()
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        terminal.close()
    await post(redis, out, type="closed", reason=reason)
    await redis.delete(in_stream(host, session))
    return reason


async def refuse(redis: Any, host: str, session: str, reason: str) -> None:
    await post(redis, out_stream(host, session), type="closed", reason=reason)
