"""WebSocket consumers for live samples. Permission is checked at subscribe and again every
``STREAM_RECHECK_S`` while the socket is open (portal/accounts/streams.py); a refused or
revoked subscription is closed with 4403 so the browser sees why. On a shared GPU a member
sees only the figures of their own projects' sandboxes: the samples' ``sandboxes`` and the
sandbox alerts of co-tenants are left out (``only`` below).

A slow client never builds a backlog: the channel-layer handlers only replace the newest
unsent sample of each device and wake a sender task, which writes what is newest whenever
the socket can take more (the ASGI server holds ``send`` while the client's TCP window is
full). So a client that stops reading costs one sample per device it watches, the channel
layer is drained at the agents' pace whatever the clients do, and an agent's ``group_send``
never waits on a browser. Alerts are few and each matters: they queue (bounded) instead.

A sandbox's own stream also carries its running cost, which the portal adds (SandboxSamples),
and its state changes (``sandbox.changed``, portal/sandboxes/live.py), on which its page
fetches its status part.

Agents publish under their host's name (``wire.telemetry``: ``host.<name>.…``, the only groups
their Redis users may publish to), so each socket listens to the groups of the host that holds
what it shows: a sandbox's current host, a GPU's host, every host for the fleet. Which those
are is asked again with each permission check (and at once when a sandbox's state changes),
so a sandbox placed or moved while its page is open is followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Self

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from portal.accounts.streams import open_streams
from portal.billing.ledger import cost_by, sandbox_usage, sandboxes_usage
from portal.billing.models import UsageRecord
from portal.telemetry.access import (
    fleet_hosts,
    hosts_of_devices,
    hosts_of_sandboxes,
    may_watch_fleet,
    may_watch_gpu,
    may_watch_sandbox,
    sandboxes_seen_on_gpu,
    sandboxes_seen_on_gpus,
    watchable_sandboxes,
)
from wire.telemetry import fleet_group, gpu_group, host_sandbox_group, sandbox_group

log = logging.getLogger(__name__)
FORBIDDEN = 4403
ALERT_BACKLOG = 100  # alerts kept for a client that is not reading; older ones are dropped
# Pieces of a batch's output kept for a client that is not reading (up to 256 KiB each); a
# page that misses some sees the gap in the offsets and reads it from the API.
OUTPUT_BACKLOG = 16
MAX_INTERVAL_MS = 60_000
STREAM_HANDLERS = {
    "gpu.sample": "gpu_sample",
    "fleet.samples": "fleet_samples",
    "alert.changed": "alert_changed",
    "sandbox.output": "sandbox_output",
    "sandbox.changed": "sandbox_changed",
}
# GPU-… and MIG-… UUIDs, simulated ones included; anything else is no group name to add.
DEVICE_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,79}")


Groups = frozenset[str]


class _SampleConsumer(AsyncJsonWebsocketConsumer):
    groups: Groups = frozenset()  # the groups this socket listens to now
    wanted: Groups = frozenset()  # those its last permission check named
    listening = False  # between its accepted connect and its close
    # Sandbox ids (as the samples key them) whose figures this user may see; None: all.
    only: frozenset[str] | None = None

    def init_stream(self) -> None:
        # device uuid (or "host:<name>" for a fleet batch) -> the newest unsent sample
        self._latest: dict[str, dict[str, Any]] = {}
        self._alerts: deque[dict[str, Any]] = deque(maxlen=ALERT_BACKLOG)
        self._outputs: deque[dict[str, Any]] = deque(maxlen=OUTPUT_BACKLOG)
        self._wake = asyncio.Event()
        self._interval_s = 0.0
        self._interval_changed = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self.coalesced = 0  # samples replaced before they were sent (for tests and logs)

    def start_sender(self) -> None:
        self._sender = asyncio.create_task(self._send_forever())

    async def connect(self) -> None:
        self.init_stream()
        await self.accept()
        groups = await database_sync_to_async(self.authorize)(self.scope.get("user"))
        if groups is None:
            await self.close(code=FORBIDDEN)
            return
        self.start_sender()
        self.listening = True
        await self._listen_to(groups)
        open_streams().watch(self, self._revoked)

    async def _listen_to(self, groups: Groups) -> None:
        for group in groups - self.groups:
            await self.channel_layer.group_add(group, self.channel_name)
        for group in self.groups - groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        self.groups = groups

    async def rechecked(self) -> None:
        """After a permission check that allowed it (``still_allowed_all`` set ``wanted``):
        the groups of the host that holds what it shows now."""
        if self.listening and self.wanted != self.groups:
            await self._listen_to(self.wanted)

    async def _revoked(self) -> None:
        log.info(
            "closing %s for %s: no longer allowed",
            ", ".join(sorted(self.groups)),
            getattr(self.scope.get("user"), "pk", None),
        )
        self.listening = False
        await self._listen_to(frozenset())
        await self.close(code=FORBIDDEN)

    async def disconnect(self, code: int) -> None:
        open_streams().forget(self)
        self.listening = False
        if self.groups:
            await self._listen_to(frozenset())
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Stream messages go straight to their handler: Channels would first clean up
        stale database connections on its one sync thread, per message and per client,
        and these handlers never touch the database."""
        handler = STREAM_HANDLERS.get(message.get("type", ""))
        if handler is None:
            await super().dispatch(message)
            return
        await getattr(self, handler)(message)

    def _keep_newest(self, key: str, event: dict[str, Any]) -> None:
        if self._latest.pop(key, None) is not None:
            self.coalesced += 1
        self._latest[key] = event
        self._wake.set()

    async def gpu_sample(self, event: dict[str, Any]) -> None:
        only = self.only
        if only is not None and any(key not in only for key in event.get("sandboxes", {})):
            event = {**event, "sandboxes": {k: v for k, v in event["sandboxes"].items() if k in only}}
        self._keep_newest(event["gpu"], event)

    async def fleet_samples(self, event: dict[str, Any]) -> None:
        self._keep_newest(f"host:{event['host']}", event)

    async def alert_changed(self, event: dict[str, Any]) -> None:
        if (
            self.only is not None
            and event.get("sandbox") is not None
            and str(event["sandbox"]) not in self.only
        ):
            return  # a co-tenant's sandbox alert
        self._alerts.append(event)
        self._wake.set()

    async def sandbox_output(self, event: dict[str, Any]) -> None:
        self._outputs.append(event)  # only on a sandbox's own group: its watchers may read it
        self._wake.set()

    async def sandbox_changed(self, event: dict[str, Any]) -> None:
        # Only on a sandbox's own group; a page needs the newest state, not every step.
        self._keep_newest(f"sandbox:{event['sandbox']}", event)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """``{"action": "interval", "ms": N}``: at most one sample per device every N ms
        (a hidden tab asks for fewer); anything else is answered with an error message."""
        if isinstance(content, dict) and content.get("action") == "interval":
            ms = content.get("ms")
            if isinstance(ms, int) and not isinstance(ms, bool) and 0 <= ms <= MAX_INTERVAL_MS:
                self._interval_s = ms / 1000
                self._interval_changed.set()  # a shown tab must not wait out the hidden pace
                self._wake.set()
                return
            await self.send_json({"type": "error", "field": "ms", "detail": f"0 to {MAX_INTERVAL_MS}"})
            return
        await self.send_json({"type": "error", "field": "action", "detail": "only 'interval' is understood"})

    async def _send_forever(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._alerts:
                    await self.send_json(self._alerts.popleft())
                while self._outputs:
                    await self.send_json(self._outputs.popleft())
                batch, self._latest = self._latest, {}
                for message in batch.values():
                    await self.send_json(message)
                if self._interval_s:
                    self._interval_changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._interval_changed.wait(), self._interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # the socket went away mid-send: disconnect() follows
            log.debug("telemetry sender for %s stopped", self.channel_name, exc_info=True)

    def authorize(self, user: Any) -> Groups | None:
        """The groups this user may listen to for this socket (also set as ``wanted``); None:
        refused."""
        raise NotImplementedError

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        """``authorize`` again for every open socket of this class at once (bulk queries),
        updating what each one filters or adds as ``authorize`` does."""
        raise NotImplementedError


class SandboxSamples(_SampleConsumer):
    """A sandbox's own samples, each with its running cost added to its figures: agents know
    no price and compute no cost, so the cost is billing's (``portal.billing.ledger``), at the
    sample's time, from the sandbox's usage intervals. Those are read with each permission
    check (connect, then every ``STREAM_RECHECK_S``), so the handler stays off the database
    and a new placement's interval joins within one re-check."""

    usage: list[UsageRecord]

    def authorize(self, user: Any) -> Groups | None:
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        if not may_watch_sandbox(user, sandbox_id):
            return None
        self.usage = sandbox_usage(sandbox_id)
        self.wanted = self.groups_of(int(sandbox_id), hosts_of_sandboxes([int(sandbox_id)]))
        return self.wanted

    @staticmethod
    def groups_of(sandbox_id: int, hosts: dict[int, str]) -> Groups:
        """The portal's notices of it, and its figures from the host it is on (if placed)."""
        host = hosts.get(sandbox_id)
        own = {host_sandbox_group(host, sandbox_id)} if host else set()
        return frozenset({sandbox_group(sandbox_id), *own})

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        ids = [int(c.scope["url_route"]["kwargs"]["sandbox_id"]) for c, _ in asks]
        allowed = watchable_sandboxes([(user, pk) for (_, user), pk in zip(asks, ids, strict=True)])
        kept = {pk for pk, ok in zip(ids, allowed, strict=True) if ok}
        usage, hosts = sandboxes_usage(kept), hosts_of_sandboxes(kept)
        for (consumer, _), pk, ok in zip(asks, ids, allowed, strict=True):
            if ok:
                consumer.usage = usage[pk]
                consumer.wanted = cls.groups_of(pk, hosts)
        return allowed

    async def sandbox_changed(self, event: dict[str, Any]) -> None:
        """Placed, moved or requeued: its figures come from another host now (or none)."""
        await super().sandbox_changed(event)
        sandbox_id = int(self.scope["url_route"]["kwargs"]["sandbox_id"])
        hosts = await database_sync_to_async(hosts_of_sandboxes)([sandbox_id])
        self.wanted = self.groups_of(sandbox_id, hosts)
        await self.rechecked()

    async def gpu_sample(self, event: dict[str, Any]) -> None:
        key = str(self.scope["url_route"]["kwargs"]["sandbox_id"])
        own = (event.get("sandboxes") or {}).get(key)
        t_ms = event.get("t")
        if isinstance(own, dict) and isinstance(t_ms, int | float) and not isinstance(t_ms, bool):
            cost = cost_by(self.usage, datetime.fromtimestamp(t_ms / 1000, tz=UTC))
            event = {**event, "sandboxes": {**event["sandboxes"], key: {**own, "cost_micros": cost}}}
        await super().gpu_sample(event)


class GpuSamples(_SampleConsumer):
    def authorize(self, user: Any) -> Groups | None:
        """Also (re)sets whose sandbox figures this user sees on the GPU (every re-check:
        a sandbox of theirs may have joined or left it)."""
        uuid = self.scope["url_route"]["kwargs"]["uuid"]
        if not DEVICE_UUID.fullmatch(uuid) or not may_watch_gpu(user, uuid):
            return None
        seen = sandboxes_seen_on_gpu(user, uuid)
        self.only = None if seen is None else frozenset(str(pk) for pk in seen)
        self.wanted = self.groups_of(uuid, hosts_of_devices([uuid]))
        return self.wanted

    @staticmethod
    def groups_of(uuid: str, hosts: dict[str, str]) -> Groups:
        host = hosts.get(uuid)
        return frozenset({gpu_group(host, uuid)} if host else set())

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        uuids = [c.scope["url_route"]["kwargs"]["uuid"] for c, _ in asks]
        seen_all = sandboxes_seen_on_gpus([(user, uuid) for (_, user), uuid in zip(asks, uuids, strict=True)])
        hosts = hosts_of_devices(set(uuids))
        for (consumer, _), seen, uuid in zip(asks, seen_all, uuids, strict=True):
            consumer.only = None if seen is None else frozenset(str(pk) for pk in seen)
            consumer.wanted = cls.groups_of(uuid, hosts)
        return [seen is None or bool(seen) for seen in seen_all]


class FleetSamples(_SampleConsumer):
    """Every host's group: a host enrolled while the page is open joins at the next check."""

    def authorize(self, user: Any) -> Groups | None:
        if not may_watch_fleet(user):
            return None
        self.wanted = frozenset(fleet_group(host) for host in fleet_hosts())
        return self.wanted

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        groups = frozenset(fleet_group(host) for host in fleet_hosts())
        for consumer, _ in asks:
            consumer.wanted = groups
        return [may_watch_fleet(user) for _, user in asks]
