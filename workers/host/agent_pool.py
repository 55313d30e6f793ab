"""One agent process serving many simulated hosts (``GPUSHARE_HOSTS_FILE``), so that the
Alibaba cluster's 1,213 hosts run on one machine (issue 20).

Each host stays a host to the control plane: its own queue (``host.<name>``), inventory,
heartbeats and reconcile, with simulated GPUs and the state-only driver (real hosts keep
one agent each: ``workers.agent``). What they share is what would swamp a small machine
or the control worker if each host had its own: their first inventories go together, a
hundred hosts a message (``workers.host.agent.announce``), one thread beats for all of them
(a round in one ``agent_heartbeats`` message, their liveness in one Redis round trip, each
host's report only when it changed or is due: ``ReportGate``), one loop samples them all,
and a few threads build their reports.

The hosts file is a CSV with a header: ``name,gpus,cpus,memory_gib``, where ``gpus`` is
``GPUSHARE_SIM_GPUS``'s syntax (``V100M32:8``; empty for a CPU-only host).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import redis

from wire import config
from wire.env import ConfigError
from workers.gpu.simulated import parse_sim_spec
from workers.host.agent import Agent, announce, run_loop
from workers.host.agent_settings import AgentSettings
from workers.host.reports import send_beats
from workers.host.sampler import tick_forever

log = logging.getLogger(__name__)
REPORT_BUILDERS = 4  # threads building the hosts' reports (listing the state-only driver is quick)
# A full report every minute: a changed one goes at once (BENCHMARKS.md, heartbeats).
POOL_FULL_REPORT_S = 60.0


@dataclass(frozen=True)
class SimulatedHost:
    name: str
    gpus: str  # GPUSHARE_SIM_GPUS syntax
    cpus: int
    memory_mib: int

    def settings(self, base: AgentSettings) -> AgentSettings:
        """This host's agent settings: ``base`` with its name, GPUs, CPUs and memory."""
        return dataclasses.replace(
            base, host=self.name, sim_gpus=self.gpus, sim_host_cpus=self.cpus,
            sim_host_memory_mib=self.memory_mib, gpu_backend="simulated", sandbox_driver="simulated",
            full_report_s=base.full_report_s or POOL_FULL_REPORT_S,
        )  # fmt: skip


def read_hosts_file(path: Path) -> list[SimulatedHost]:
    """The hosts of ``path``; a bad line is a ConfigError naming it."""
    hosts: list[SimulatedHost] = []
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"GPUSHARE_HOSTS_FILE={path}: {exc.strerror}") from exc
    seen: set[str] = set()
    for line, row in enumerate(rows, start=2):
        try:
            name = row["name"].strip()
            gpus = (row["gpus"] or "").strip()
            if gpus:
                parse_sim_spec(gpus)
            host = SimulatedHost(name, gpus, int(row["cpus"]), int(float(row["memory_gib"]) * 1024))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"GPUSHARE_HOSTS_FILE={path}, line {line}: {exc} (columns: name,gpus,cpus,memory_gib)"
            ) from exc
        if not name or name in seen:
            raise ConfigError(f"GPUSHARE_HOSTS_FILE={path}, line {line}: host name {name!r} empty or twice")
        seen.add(name)
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"GPUSHARE_HOSTS_FILE={path} names no host")
    return hosts


class AgentPool:
    """The agents of the hosts one process serves (``workers.agent.get_pool`` builds them),
    and the loops they share."""

    def __init__(self, agents: dict[str, Agent], settings: AgentSettings, builders: Executor) -> None:
        self.agents = agents
        self.settings = settings
        self._builders = builders
        self.stopping = threading.Event()
        self._redis = redis.Redis.from_url(config.redis_url(), socket_timeout=2)  # connects on first use

    def for_queue(self, queue: str | None) -> Agent:
        host = (queue or "").removeprefix("host.")
        try:
            return self.agents[host]
        except KeyError:
            raise LookupError(f"this agent process serves no host for the queue {queue!r}") from None

    def start(self) -> None:
        announce(list(self.agents.values()))
        threading.Thread(target=self._beat_forever, name="pool-beats", daemon=True).start()
        samplers = [agent.sampler for agent in self.agents.values()]
        run_loop(tick_forever(samplers, self.settings.sample_interval_s, self.stopping), "pool-sampler")
        log.info("agent pool: %d simulated hosts started", len(self.agents))

    def beat_round(self) -> None:
        """Every host's beat: their liveness in one round trip, the beats in a few messages."""
        send_beats(self._redis, [agent.reports.beat() for agent in self.agents.values()])

    def _beat_forever(self) -> None:
        interval = self.settings.heartbeat_s
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.beat_round()
            except Exception:  # the broker refused it: the next round tries again
                log.exception("heartbeat round not sent")
            took = time.monotonic() - started
            if took > interval:
                log.warning("a round of %d beats took %.1f s (> %s s)", len(self.agents), took, interval)
            self.stopping.wait(max(0.0, interval - took))

    def shutdown(self) -> None:
        self.stopping.set()
        self._builders.shutdown(wait=False)
