"""One process in front of a Slurm cluster that presents every Slurm node as a gpushare host
(issue 39), the shape of ``workers.host.agent_pool``: each node is an ``Agent`` with its own
queue (``host.<prefix><node>``), inventory, heartbeats and reconcile, whose GPU backend is
the node's GRES (``workers.slurm.gpus``) and whose driver submits Slurm jobs
(``workers.slurm.driver``).

Every ``GPUSHARE_SLURM_POLL_MS`` the gateway reads all nodes and jobs (``ClusterView``, two
requests whatever the cluster's size). Then:

- a node Slurm marks down (or not responding) gets no heartbeat, so gpushare loses it as it
  loses any host whose agent stopped beating, within the same bound; it beats again, with a
  fresh inventory, once Slurm has it back;
- a node whose GPUs changed (a job outside gpushare took one or freed it, Slurm drained the
  node) has its inventory sent again: those GPUs are offered to nobody, and the fleet page
  says which job holds them;
- a node that appeared is enrolled: its agent is made, announced, and its queue consumed;
- each gpushare job that ended has slurmdbd's record of it sent to the control plane, which
  checks its ledger against it (``workers.slurm.accounting``).

The gateway is enrolled as a pool (``manage.py host_credential issue --pool <prefix>``): it
may speak for, and read the queues of, hosts named with its prefix only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from wire import config
from wire.celery import host_queue
from workers.host.agent import Agent, announce, run_loop
from workers.host.agent_settings import AgentSettings
from workers.host.reports import send_beats
from workers.host.sampler import Sampler, tick_forever
from workers.slurm.accounting import AccountingWatch
from workers.slurm.driver import SlurmDriver
from workers.slurm.feed import MonitorFeed
from workers.slurm.gpus import SlurmGpus
from workers.slurm.model import SlurmFormatError
from workers.slurm.rest import SlurmError
from workers.slurm.settings import SlurmSettings
from workers.slurm.view import ClusterView

log = logging.getLogger(__name__)
REPORT_BUILDERS = 2
GATEWAY_FULL_REPORT_S = 60.0


class SlurmGateway:
    def __init__(
        self,
        settings: SlurmSettings,
        base: AgentSettings,
        var_dir: Path,
        prefix: str = "",
    ) -> None:
        self.settings = settings
        self.base = base
        self.var_dir = var_dir
        self.prefix = prefix
        self.models = dict(settings.gpu_models)
        self.rest = settings.client()
        self.view = ClusterView(self.rest)
        self.agents: dict[str, Agent] = {}  # gpushare host name -> its agent
        self.stopping = threading.Event()
        self._builders = ThreadPoolExecutor(REPORT_BUILDERS, thread_name_prefix="slurm-report")
        self._sent: dict[str, list[dict[str, object]]] = {}  # host -> the GPUs its last inventory listed
        self._down: set[str] = set()  # hosts whose node Slurm has down: no beats
        self._redis = redis.Redis.from_url(config.redis_url(), socket_timeout=2)
        self._consume: Callable[[str], None] = lambda queue: None
        self._last_beat = 0.0
        self._samplers: list[Sampler] = []
        self.accounting = AccountingWatch(self.rest, self.view)
        # The nodes' monitors' samples, read for all nodes once a sampling round.
        self.feed = MonitorFeed(self._redis, base.sample_interval_s / 2)

    def host_name(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def for_queue(self, queue: str | None) -> Agent:
        host = (queue or "").removeprefix("host.")
        try:
            return self.agents[host]
        except KeyError:
            raise LookupError(f"this Slurm gateway serves no host for the queue {queue!r}") from None

    # --- starting -----------------------------------------------------------------------

    def start(self, consume: Callable[[str], None]) -> None:
        """``enrol``, then poll on a thread of its own."""
        self.enrol(consume)
        threading.Thread(target=self._poll_forever, name="slurm-poll", daemon=True).start()
        # The sampler loop does for each Slurm node what it does for a host: its GPUs' samples
        # (its monitor's, through the feed) to their groups, rollups, alert rules, /metrics,
        # its batches' output. The list grows as nodes are enrolled.
        run_loop(tick_forever(self._samplers, self.base.sample_interval_s, self.stopping), "slurm-sampler")
        log.info("Slurm gateway: %d nodes of %s", len(self.agents), self.settings.url)

    def enrol(self, consume: Callable[[str], None]) -> None:
        """Read the cluster (waiting for slurmrestd) and make, announce and consume the queue
        of each node's agent. ``consume``: starts consuming a queue (the Celery consumer's
        ``add_task_queue``)."""
        self._consume = consume
        while not self.stopping.is_set():
            try:
                self.view.refresh()
                break
            except (SlurmError, SlurmFormatError) as exc:
                log.error("Slurm gateway: cannot read the cluster yet: %s", exc)
                self.stopping.wait(self.settings.poll_s)
        self._enrol_new_nodes()

    def _agent(self, node: str) -> Agent:
        host = self.host_name(node)
        full_report_s = self.base.full_report_s or GATEWAY_FULL_REPORT_S
        own = dataclasses.replace(self.base, host=host, full_report_s=full_report_s)
        var = self.var_dir / "agents" / host
        var.mkdir(parents=True, exist_ok=True)
        backend = SlurmGpus(host, node, self.view, self.settings.simulated_gpus, self.models, self.feed)
        self.feed.watch(host, node)
        driver = SlurmDriver(host, node, self.settings, self.rest, self.view)
        return Agent(host, backend, driver, var, own, self._builders)

    def _enrol_new_nodes(self) -> None:
        fresh = []
        for node in sorted(self.view.nodes):
            host = self.host_name(node)
            if host in self.agents:
                continue
            agent = self._agent(node)
            self.agents[host] = agent
            self._samplers.append(agent.sampler)
            self._consume(host_queue(host))
            fresh.append(agent)
        up = [a for a in fresh if not self._node_down(a)]
        if up:
            announce(up)
            for agent in up:
                self._sent[agent.host] = [g.to_json() for g in agent.context.inventory.gpus]

    # --- each poll ----------------------------------------------------------------------

    def _node_down(self, agent: Agent) -> bool:
        backend = agent.context.backend
        assert isinstance(backend, SlurmGpus)  # noqa: S101 - every agent here has one
        node = self.view.node(backend.node)
        return node is None or node.down

    def poll_round(self) -> None:
        """Read the cluster; enrol new nodes; re-send what changed; beat for the nodes up."""
        self.view.refresh()
        self._enrol_new_nodes()
        back: list[Agent] = []
        for host, agent in self.agents.items():
            if self._node_down(agent):
                if host not in self._down:
                    log.warning("Slurm node of %s is down: no more heartbeats for it", host)
                self._down.add(host)
                continue
            if host in self._down:
                self._down.discard(host)
                back.append(agent)
                continue
            gpus = [g.to_json() for g in agent.context.backend.list_gpus()]
            if gpus != self._sent.get(host):
                agent.report_inventory()
                self._sent[host] = gpus
        if back:  # as an agent that starts: its inventory first, marked as a fresh start
            announce(back)
            for agent in back:
                self._sent[agent.host] = [g.to_json() for g in agent.context.inventory.gpus]
        self.accounting.round()
        if time.monotonic() - self._last_beat >= self.base.heartbeat_s:
            self._last_beat = time.monotonic()
            beats = [a.reports.beat() for h, a in self.agents.items() if h not in self._down]
            if beats:
                send_beats(self._redis, beats)

    def _poll_forever(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.poll_round()
            except (SlurmError, SlurmFormatError) as exc:  # slurmrestd away: no beats, hosts go lost
                log.error("Slurm gateway: cannot read the cluster: %s", exc)
            except Exception:  # the broker refused a message: the next round tries again
                if self.stopping.is_set():
                    return  # shut down in the middle of the round: its builders are gone
                log.exception("Slurm gateway: poll round failed")
            self.stopping.wait(max(0.0, self.settings.poll_s - (time.monotonic() - started)))

    def shutdown(self) -> None:
        self.stopping.set()
        self._builders.shutdown(wait=False)
