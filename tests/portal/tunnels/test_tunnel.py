"""The relay's Redis streams (``wire/relay.py``, the portal's end in
``portal/tunnels/tunnel.py``): a slow reader gets every piece while the agent waits for
it, reads cancelled halfway lose nothing, and a piece missing all the same ends the stream
instead of corrupting it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from channels.testing import ApplicationCommunicator
from django.conf import settings
from django.test import override_settings
from redis.asyncio import Redis

from portal.asgi import application
from portal.tunnels import app_access
from portal.tunnels.tunnel import Tunnel, TunnelClosed
from tests.portal.tunnels.test_app_proxy import APPS, app_host, app_session_for, with_app
from tests.portal.tunnels.test_terminal import WAIT_S, running_sandbox
from wire.relay import WINDOW, InOrder, StreamBroken, out_stream, post, relay

PIECE = 64 * 1024


class Firehose:
    """A stream that has ``count`` pieces ready at once, each of PIECE bytes naming its number."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.reads = 0
        self.closed = False

    def piece(self, number: int) -> bytes:
        return f"{number:08d}".encode().ljust(PIECE, b".")

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self.reads == self.count:
            raise EOFError("all sent")
        self.reads += 1
        return self.piece(self.reads)

    def write(self, data: bytes) -> None:
        pass

    def resize(self, rows: int, cols: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


async def read_all(
    tunnel: Tunnel, stream: Firehose, pause: bool, cancel_reads: bool
) -> tuple[list[bytes], int, str]:
    """Every piece ``tunnel`` gets, the most the agent ever read ahead of the reader, and why
    the stream ended. ``pause``: 2 s after the second piece; ``cancel_reads``: most reads
    are given up after 1 ms (a request ending while its read waits) and tried again. Every
    third read is let finish: where a Redis round trip takes over 1 ms (the embedded one,
    a loaded machine) a stream whose every read is cancelled would never move."""
    got: list[bytes] = []
    ahead = 0
    attempts = 0
    try:
        while True:
            attempts += 1
            if cancel_reads and attempts % 3:
                try:
                    piece = await asyncio.wait_for(tunnel.read(WAIT_S), 0.001)
                except TimeoutError:
                    continue
            else:
                piece = await tunnel.read(WAIT_S)
            got.append(piece)
            ahead = max(ahead, stream.reads - len(got))  # read from the stream, not yet by the reader
            if pause and len(got) == 2:
                await asyncio.sleep(2)
    except TunnelClosed as closed:
        return got, ahead, closed.reason


@pytest.mark.parametrize("cancel_reads", [False, True], ids=["slow-reader", "cancelled-reads"])
def test_every_piece_arrives_in_order_while_the_agent_waits_for_the_reader(
    sent_tasks: Any, cancel_reads: bool
) -> None:
    stream = Firehose(count=5 * WINDOW)

    async def run() -> tuple[list[bytes], int, str]:
        tunnel = Tunnel()
        await tunnel.open("h1", "open_terminal", "alloc-1", None)
        async with Redis.from_url(settings.REDIS_URL) as agent_redis:
            agent = asyncio.create_task(relay(agent_redis, stream, tunnel.host, tunnel.session, idle_s=30))
            await tunnel.wait_opened(WAIT_S)
            result = await read_all(tunnel, stream, pause=not cancel_reads, cancel_reads=cancel_reads)
            await tunnel.close()
            await agent
        return result

    got, ahead, reason = asyncio.run(run())
    assert got == [stream.piece(n) for n in range(1, stream.count + 1)]
    assert ahead <= WINDOW
    assert reason == "all sent" and stream.closed
    assert [t[1] for t in sent_tasks] == ["open_terminal"]


def test_a_piece_out_of_order_is_a_broken_stream() -> None:
    order = InOrder()
    assert order.take({"type": b"output", "data": b"a", "seq": b"1"}) == b"a"
    with pytest.raises(StreamBroken, match="piece 2 of the stream was lost"):
        order.take({"type": b"output", "data": b"c", "seq": b"3"})


@pytest.mark.django_db(transaction=True)
def test_an_answer_that_loses_a_piece_is_broken_off_not_passed_on_as_whole(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sandbox = with_app(running_sandbox(people, catalog))
    apps_on = override_settings(APPS=APPS, PORTAL_URL="http://gpus.test")
    apps_on.enable()
    cookie = f"{app_access.cookie_name()}={app_session_for(people['owner'], sandbox)}".encode()
    scope = {
        "type": "http", "method": "GET", "path": "/big.js", "query_string": b"",
        "headers": [(b"host", app_host(sandbox)), (b"cookie", cookie)], "scheme": "http",
        "client": ("127.0.0.1", 1),
    }  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/javascript\r\ncontent-length: 8\r\n\r\n"

    async def agent_losing_piece_2() -> None:
        deadline = time.monotonic() + WAIT_S
        while not (asked := [t for t in sent_tasks if t[1] == "open_app"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        out = out_stream(asked[0][0].removeprefix("host."), asked[0][2][0])
        async with Redis.from_url(settings.REDIS_URL) as redis:
            await post(redis, out, type="opened")
            await post(redis, out, type="output", seq=1, data=head + b"abc")
            await post(redis, out, type="output", seq=3, data=b"fgh")

    async def run() -> list[dict[str, Any]]:
        comm = ApplicationCommunicator(application, scope)
        await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
        await agent_losing_piece_2()
        sent = [await comm.receive_output(WAIT_S), await comm.receive_output(WAIT_S)]
        await comm.wait(WAIT_S)  # the consumer returned...
        assert await comm.receive_nothing()  # ...without ending the body: the server drops the connection
        return sent

    try:
        with caplog.at_level(logging.WARNING, logger="portal.tunnels.app_proxy"):
            start, body = asyncio.run(run())
    finally:
        apps_on.disable()
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert body == {"type": "http.response.body", "body": b"abc", "more_body": True}
    assert "piece 2 of the stream was lost" in caplog.text
