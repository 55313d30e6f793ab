"""Streaming to slow clients: the newest sample per device, never a backlog; and to many
clients of one web process: one Redis message per group, however many watch it.

The unit test drives a consumer whose socket is stuck; the e2e test floods a real uvicorn
with samples for a client that stopped reading and watches the server's memory.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from pathlib import Path
from typing import Any

import pytest
import redis
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore

from portal.asgi import application
from portal.fleet.models import Gpu
from portal.telemetry.consumers import GpuSamples
from tests.conftest import seed_host
from tests.e2e.platform import Platform
from tests.factories import UserFactory
from tests.portal.helpers import client_for
from wire.telemetry import fleet_group, gpu_group
from workers.host.telemetry import make_layer


def gpu_sample(uuid: str, t: int, padding: int = 0) -> dict[str, Any]:
    # Random padding: compression must not shrink the flood into the sockets' buffers.
    return {"type": "gpu.sample", "gpu": uuid, "t": t, "temp_c": 50.0, "pad": secrets.token_hex(padding // 2)}


def test_a_stuck_socket_holds_one_sample_per_device_and_alerts_queue() -> None:
    async def scenario() -> tuple[GpuSamples, list[dict[str, Any]]]:
        consumer = GpuSamples()
        consumer.init_stream()
        gate = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def send_json(message: dict[str, Any], close: bool = False) -> None:
            await gate.wait()  # the client's TCP window is full
            sent.append(message)

        consumer.send_json = send_json
        consumer.start_sender()
        for t in range(10_000):
            await consumer.gpu_sample(gpu_sample(f"GPU-{t % 4}", t))
            if t % 1000 == 0:
                await asyncio.sleep(0)  # let the sender take one and block on it
        await consumer.alert_changed({"type": "alert.changed", "key": "k", "state": "raised"})
        assert len(consumer._latest) == 4  # memory: one sample per device, whatever the flood
        gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
        await consumer.disconnect(1000)
        return consumer, sent

    consumer, sent = asyncio.run(scenario())
    assert len(sent) <= 6  # the one in flight, the alert and the newest of each device
    assert [m["t"] for m in sent[-4:]] == [9996, 9997, 9998, 9999]
    assert any(m["type"] == "alert.changed" for m in sent)
    assert consumer.coalesced >= 9990


def test_the_interval_action_is_checked() -> None:
    async def scenario() -> list[dict[str, Any]]:
        consumer = GpuSamples()
        consumer.init_stream()
        replies: list[dict[str, Any]] = []

        async def send_json(message: dict[str, Any], close: bool = False) -> None:
            replies.append(message)

        consumer.send_json = send_json
        await consumer.receive_json({"action": "interval", "ms": 10_000})
        assert consumer._interval_s == 10.0
        await consumer.receive_json({"action": "interval", "ms": "soon"})
        await consumer.receive_json({"action": "interval", "ms": 10**9})
        await consumer.receive_json({"action": "subscribe", "group": "fleet"})
        return replies

    replies = asyncio.run(scenario())
    assert [r["field"] for r in replies] == ["ms", "ms", "action"]


@pytest.mark.django_db(transaction=True)  # consumers read in their own thread
def test_one_publish_reaches_every_socket_on_a_gpu_through_one_subscription(people: Any) -> None:
    """The agent's layer and the portal's speak Redis pub/sub: the web process subscribes to a
    GPU's group once for all its sockets on it, so a sample is one Redis message per process,
    not one per socket (issue 37: 2,000 open pages)."""
    seed_host("fanout", "A100-80GB:1")
    uuid = Gpu.objects.get(host__name="fanout").uuid
    cookie = f"sessionid={client_for(people['admin']).cookies['sessionid'].value}".encode()
    headers = [(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)]
    sockets = [WebsocketCommunicator(application, f"/ws/gpus/{uuid}/", headers=headers) for _ in range(3)]

    async def scenario() -> tuple[int, list[dict[str, Any]]]:
        for sock in sockets:
            assert (await sock.connect())[0]
        await asyncio.sleep(0.3)  # each consumer's group_add lands after its accept
        client = redis.Redis.from_url(settings.REDIS_URL)
        numsub: Any = client.pubsub_numsub(f"asgi__group__{gpu_group('fanout', uuid)}")  # a sync client
        [(_, subscribers)] = numsub
        client.close()
        agent = make_layer(settings.REDIS_URL)
        await agent.group_send(gpu_group("fanout", uuid), gpu_sample(uuid, 7))
        received = [await sock.receive_json_from(timeout=5) for sock in sockets]
        await agent.flush()
        for sock in sockets:
            await sock.disconnect()
        return int(subscribers), received

    subscribers, received = asyncio.run(scenario())
    assert subscribers == 1, "one subscription per web process, not one per socket"
    assert [(m["gpu"], m["t"]) for m in received] == [(uuid, 7)] * 3


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _staff_cookie() -> str:
    admin: Any = UserFactory(username="watcher", is_staff=True)
    session = SessionStore()
    session[SESSION_KEY] = str(admin.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = admin.get_session_auth_hash()
    session.save()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_client_that_stops_reading_does_not_grow_the_server(tmp_path: Path, transactional_db: Any) -> None:
    import websockets

    cookie = _staff_cookie()
    seed_host("flood", "A100-80GB:1")  # the fleet page listens to each host's group
    (tmp_path / "logs").mkdir()
    platform = Platform(tmp_path / "var", tmp_path / "logs")
    base = platform.start_web()
    web_pid = platform.procs["web"].pid
    flood, padding = 4_000, 16_384  # 64 MiB of samples if the server kept them

    async def scenario() -> tuple[int, int, list[dict[str, Any]]]:
        layer = make_layer(settings.REDIS_URL)
        url = base.replace("http", "ws") + "/ws/fleet/"
        # A small receive buffer, so the kernel does not hold most of the flood for the client.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", platform.port))
        sock.setblocking(False)
        async with websockets.connect(
            url,
            sock=sock,
            additional_headers={"Cookie": cookie},
            origin=base,  # type: ignore[arg-type]
            max_queue=2,
            max_size=2**20,
            ping_interval=None,  # the client's own pings would time out: it is not reading
            compression=None,
        ) as ws:
            await asyncio.sleep(0.5)  # subscribed
            for t in range(100):  # warm the server up before measuring
                await layer.group_send(fleet_group("flood"), gpu_sample(f"GPU-{t % 8}", t, padding))
            await asyncio.sleep(1)
            before = _rss_kib(web_pid)
            # The client reads nothing from here on: its queue (2 messages), then its socket
            # buffers fill, then the server's; the server must then keep only the newest.
            for t in range(100, flood):
                await layer.group_send(fleet_group("flood"), gpu_sample(f"GPU-{t % 8}", t, padding))
                if t % 40 == 0:
                    await asyncio.sleep(0.1)  # ~400 a second: the server keeps up, the client does not
            await asyncio.sleep(2)
            after = _rss_kib(web_pid)
            received = []
            while True:
                try:
                    received.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=2)))
                except TimeoutError:
                    break
        return before, after, received

    try:
        before, after, received = asyncio.run(scenario())
    except BaseException:
        print(platform.logs())
        raise
    finally:
        platform.stop()
    grown_mib = (after - before) / 1024
    print(
        f"server RSS {before / 1024:.0f} MiB -> {after / 1024:.0f} MiB; {len(received)} of {flood} delivered"
    )
    assert grown_mib < 24, f"the server grew {grown_mib:.0f} MiB for a client that does not read"
    # What was in the socket buffers comes first, then only the newest sample of each GPU.
    newest = {m["gpu"]: m["t"] for m in received if m.get("type") == "gpu.sample"}
    assert newest == {f"GPU-{t % 8}": t for t in range(flood - 8, flood)}
    assert len(received) < flood // 2
