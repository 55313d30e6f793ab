"""One twin run: a fresh database and Redis, the trace's fleet brought up as simulated hosts
of one agent process, the trace's pods requested through the request form and
``do_request_sandbox``, and what the control plane did with them measured.

Without departures (``--no-departures``) the pods arrive as the replay's engine sends
them (``scheduler.research.live_replay.replay_live``): the seed's workload in order, a
batch at a time, each batch requested in one transaction; a request no host takes in the
cycle that decides it is withdrawn, as the replay counts such a pod failed. Then the
placements the portal committed are compared with the replay's on the same pods.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from psycopg.conninfo import make_conninfo

from portal.fleet import credentials
from portal.telemetry import control_figures
from portal.twin import arrivals, report
from portal.twin.cluster import Services, write_hosts_file
from portal.twin.monitor import Monitor, fleet_size
from portal.twin.population import LONGEST, WEIGHTS, populate
from scheduler.gpus import CATALOG
from scheduler.research.bench_trace import bucket_curve
from scheduler.research.live_replay import replay_live, result_of_placements
from scheduler.research.replay import write_placements
from scheduler.research.result import ReplayResult
from scheduler.research.trace import NodeSpec, PodSpec, Workload, build_workload, load_nodes, load_pods

log = logging.getLogger(__name__)
FLEET_UP_TIMEOUT_S = 600.0
DECIDE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunOptions:
    """What every twin run is given: the trace's node and pod lists, its folder, and how
    many projects its users belong to."""

    nodes: Path
    pods: Path
    out: Path
    projects: int = len(WEIGHTS)


@dataclass(frozen=True)
class TwinOptions(RunOptions):
    """A run without departures, batched as the replay batches."""

    seed: int = 42
    tune: float = 1.3
    batch: int = 100
    until_arrived_pct: float = 101.0


class TwinSetupError(Exception):
    """The twin refuses to start: it would wipe a database not meant for it, a bad trace."""


def fresh_stores() -> None:
    """Drop and create the twin's database, migrate it, and empty its Redis database. Only
    a PostgreSQL database whose name says ``twin``: the twin never wipes another."""
    db: dict[str, Any] = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql" or "twin" not in db["NAME"]:
        raise TwinSetupError(
            f"the twin runs on a PostgreSQL database of its own, named with 'twin' (DATABASE_URL names "
            f"{db['NAME']!r} on {db['ENGINE'].rsplit('.', 1)[-1]}): it drops and creates it"
        )
    connection.close()
    given = {key.lower(): str(db[key]) for key in ("HOST", "PORT", "USER", "PASSWORD") if db.get(key)}
    with psycopg.connect(make_conninfo(dbname="postgres", **given), autocommit=True) as pg:
        pg.execute(f'DROP DATABASE IF EXISTS "{db["NAME"]}" WITH (FORCE)')
        pg.execute(f'CREATE DATABASE "{db["NAME"]}"')
    call_command("migrate", verbosity=0, interactive=False)
    redis.Redis.from_url(settings.REDIS_URL).flushdb()


def refuse_model_constraints(pods: list[PodSpec]) -> None:
    constrained = sum(1 for pod in pods if pod.models)
    if constrained:
        raise TwinSetupError(
            f"{constrained} pods of the trace ask for a GPU model (gpu_spec): the portal's requests "
            "cannot say that yet; use a pod list without it (openb_pod_list_default.csv)"
        )


def wait_for_fleet(services: Services, hosts: int, gpus: int) -> float:
    """Seconds until every host reported its inventory; raises if an agent process died."""
    began = time.monotonic()
    while fleet_size() != (hosts, gpus):
        if dead := services.dead():
            raise arrivals.TwinError(f"a twin process exited while the fleet came up: {', '.join(dead)}")
        if time.monotonic() - began > FLEET_UP_TIMEOUT_S:
            raise arrivals.TwinError(
                f"the fleet is {fleet_size()} of ({hosts}, {gpus}) after {FLEET_UP_TIMEOUT_S} s"
            )
        time.sleep(1.0)
    return time.monotonic() - began


class Twin:
    """The fleet and its control plane for one run, as a context manager: on entry a fresh
    database and Redis, the run's people and tiers, the processes up and every host in
    the inventory, the monitor sampling; on exit everything stopped, whatever happened."""

    def __init__(self, out: Path, nodes: list[NodeSpec], pods: list[PodSpec], projects: int) -> None:
        self.out = out
        self.nodes = nodes
        self.pods = pods
        self.projects = projects
        self.gpus = sum(n.gpus for n in nodes)
        self.services = Services(out / "logs")
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.monitor = Monitor(self.services, self.client, [n.name for n in nodes], self.gpus, out)
        self.fleet_up_s = 0.0
        self.began_ms = 0  # when the run proper began: the fleet up, the monitor sampling

    def __enter__(self) -> Twin:
        self.out.mkdir(parents=True, exist_ok=True)
        fresh_stores()
        memory = {model: gpu.memory_mib for model, gpu in CATALOG.items()}
        self.population = populate(self.pods, self.nodes, memory, self.projects)
        hosts_file = self.out / "hosts.csv"
        write_hosts_file(self.nodes, hosts_file)
        # The pool connects as its own Redis user, for every host of the trace at once, as
        # deployed hosts do one each (issue 38).
        prefix = os.path.commonprefix([n.name for n in self.nodes])  # noqa: RUF071 - names, not paths
        if not prefix:
            raise ValueError("the trace's host names share no prefix to enrol the agent pool under")
        self.services.start(hosts_file, pool=(prefix, credentials.renew(prefix, pool=True)))
        try:
            self.fleet_up_s = round(wait_for_fleet(self.services, len(self.nodes), self.gpus), 1)
        except BaseException:
            self.services.stop()
            raise
        log.warning("twin: %d hosts, %d GPUs up in %.0f s", len(self.nodes), self.gpus, self.fleet_up_s)
        self.began_ms = int(time.time() * 1000)
        self.monitor.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.monitor.stop()
        self.services.stop()

    def control_figures(self) -> dict[str, Any]:
        """Heartbeat lag and cycle time percentiles, as the control worker recorded them, over
        the run; and apart, the heartbeats sent before it began (queued behind the hosts'
        first inventories: a cold start, ``tests/bench/test_cold_start.py``) and the cycles
        of that time."""
        out: dict[str, Any] = {}
        for name, key in (
            ("heartbeat_lag_s", control_figures.HEARTBEAT_LAG),
            ("cycle_s", control_figures.CYCLE),
        ):
            figures = control_figures.read(self.client, key)
            # A lag's entry is stamped when applied; the beat was sent that long before.
            sent = [
                (at - value if key == control_figures.HEARTBEAT_LAG else at, value) for at, value in figures
            ]
            out[name] = report.spread([v / 1000 for at, v in sent if at >= self.began_ms])
            out[f"{name}_before_the_run"] = report.spread([v / 1000 for at, v in sent if at < self.began_ms])
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": len(self.nodes), "gpus": self.gpus, "projects": self.projects,
            "policy": settings.SCHEDULER_POLICY, "fleet_up_s": self.fleet_up_s,
        }  # fmt: skip


def run_without_departures(options: TwinOptions) -> dict[str, Any]:
    workload = build_workload(load_nodes(options.nodes), load_pods(options.pods), options.seed, options.tune)
    refuse_model_constraints(workload.pods)
    summary: dict[str, Any] = {
        "mode": "no departures", "seed": options.seed, "tune": options.tune, "batch": options.batch,
    }  # fmt: skip
    with Twin(options.out, workload.nodes, workload.pods, options.projects) as twin:
        summary.update(twin.describe())
        ids, batch_s = _request_in_batches(options, workload, twin.population, twin.services)
        summary["batches"] = report.spread(batch_s)
        placed = arrivals.placements(ids)
        summary["feasibility_problems"] = report.feasibility_problems(workload.nodes)
        summary["plans"] = report.plans_run()
        summary["rollups"] = report.rollups_kept(twin.gpus)
        time.sleep(10)  # the launches' last reports, and a last sample
        summary.update(twin.control_figures())
    summary["samples"] = twin.monitor.rows()
    prefix = dataclasses.replace(workload, pods=workload.pods[: len(placed)])
    result = result_of_placements(prefix, [(p.host, p.gpus, sum(p.milli)) for p in placed])
    write_placements(result, options.out)
    began = time.perf_counter()
    replay = replay_live(prefix, options.batch)
    summary["replay_live_s"] = round(time.perf_counter() - began, 1)
    summary["comparison"] = _compare(result, replay)
    report.write_summary(options.out, summary)
    return summary


def _request_in_batches(
    options: TwinOptions, workload: Workload, population: Any, services: Services
) -> tuple[dict[int, int], list[float]]:
    """The workload's pods a batch at a time until ``until_arrived_pct``: sandbox id -> seq,
    and each batch's wall time from request to decisions."""
    ids: dict[int, int] = {}
    batch_s: list[float] = []
    arrived, limit = 0, workload.capacity_milli * options.until_arrived_pct / 100
    pods = list(enumerate(workload.pods))
    for first in range(0, len(pods), options.batch):
        if arrived >= limit:
            break
        batch = pods[first : first + options.batch]
        began = time.monotonic()
        requested = arrivals.request_pods(population, batch, lambda _pod: LONGEST)
        arrivals.wait_decided(list(requested), DECIDE_TIMEOUT_S, services.dead)
        arrivals.give_up_waiting(list(requested), population, "no host could take it when it arrived")
        batch_s.append(time.monotonic() - began)
        ids.update(requested)
        arrived += sum(pod.total_gpu_milli for _, pod in batch)
        if first // options.batch % 10 == 0:
            log.warning(
                "twin: %d pods requested, arrived %.1f %%",
                first + len(batch),
                100 * arrived / workload.capacity_milli,
            )
    return ids, batch_s


def _compare(twin: ReplayResult, replay: ReplayResult) -> dict[str, Any]:
    """Unallocated % at the arrived points both reached, and how many pods went elsewhere."""

    def curve(result: ReplayResult) -> list[float | None]:
        return bucket_curve(
            [result.pct(a) for a in result.arrived_milli], [result.pct(u) for u in result.used_milli]
        )

    ours, theirs = curve(twin), curve(replay)
    points = {}
    for x in (50, 70, 80, 90, 95, 100):
        mine, reference = ours[x], theirs[x]
        if mine is not None and reference is not None:
            points[str(x)] = {"twin": round(100 - mine, 2), "replay_live": round(100 - reference, 2),
                              "difference": round(reference - mine, 2)}  # fmt: skip
    same_node = sum(1 for a, b in zip(twin.node, replay.node, strict=True) if a == b)
    return {
        "unallocated_pct_at_arrived": points,
        "pods": len(twin.node),
        "failed": {"twin": twin.failed, "replay_live": replay.failed},
        "same_node_pct": round(100 * same_node / max(1, len(twin.node)), 2),
    }
