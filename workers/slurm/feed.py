"""The gateway's side of the node monitors (``workers.slurm.monitor``): every node's newest
tick, read from Redis for all of them at once (one MGET a sampling round, however many
nodes), so that each node's GPU backend (``workers.slurm.gpus``) answers ``sample`` as a
host's own backend does.

A node's tick is a hostile host's words (``workers.slurm.node_samples``): one that does not
decode, or that names another node, is no sample, and the log says why once per node until
it reads again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from wire.telemetry import node_samples_key
from workers.slurm.node_samples import NodeFault, NodeSamples, NodeSamplesError, decode

log = logging.getLogger(__name__)


class MonitorFeed:
    """The newest tick of each node's monitor, by gpushare host."""

    def __init__(
        self,
        client: redis.Redis,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.max_age_s = max_age_s  # a round's reads are this fresh
        self.clock = clock
        self._nodes: dict[str, str] = {}  # gpushare host -> its Slurm node
        self._ticks: dict[str, NodeSamples] = {}
        self._read_at = -float("inf")
        self._complained: set[str] = set()
        self._unread = False  # the last read failed
        self._faults_seen: dict[str, tuple[int, int]] = {}  # host -> (monitor's start, last seq)
        self._lock = threading.Lock()

    def watch(self, host: str, node: str) -> None:
        with self._lock:
            self._nodes[host] = node
            self._read_at = -float("inf")

    def latest(self, host: str) -> NodeSamples | None:
        """The node's newest tick; None when its monitor wrote none lately (not running, or
        stopped: its key expires) or wrote one that is unreadable."""
        with self._lock:
            if self.clock() - self._read_at >= self.max_age_s:
                self._read()
            return self._ticks.get(host)

    def new_faults(self, host: str) -> list[NodeFault]:
        """The node's fault events not taken before (each once, across the monitor's restarts)."""
        tick = self.latest(host)
        if tick is None:
            return []
        with self._lock:
            started, last = self._faults_seen.get(host, (tick.started_ms, 0))
            if started != tick.started_ms:
                last = 0  # a new monitor numbers from 1 again
            fresh = [f for f in tick.faults if f.seq > last]
            self._faults_seen[host] = (tick.started_ms, max([last, *(f.seq for f in fresh)]))
            return fresh

    def _read(self) -> None:
        hosts = list(self._nodes)
        self._read_at = self.clock()
        try:
            raws: list[bytes | None] = self.client.mget([node_samples_key(h) for h in hosts]) if hosts else []  # type: ignore[assignment]
        except redis.RedisError as exc:
            if self._ticks or not self._unread:  # once, as the reads start failing
                log.warning("node monitors' samples not read: %s", exc)
            self._ticks, self._unread = {}, True
            return
        self._unread = False
        ticks: dict[str, NodeSamples] = {}
        for host, raw in zip(hosts, raws, strict=True):
            if raw is None:
                continue
            try:
                tick = decode(raw)
                if tick.node != self._nodes[host]:
                    raise NodeSamplesError(f"node: {tick.node!r}, not {self._nodes[host]!r}")
            except NodeSamplesError as exc:
                if host not in self._complained:
                    log.error("the monitor of %s wrote samples that cannot be read: %s", host, exc)
                    self._complained.add(host)
                continue
            self._complained.discard(host)
            ticks[host] = tick
        self._ticks = ticks
