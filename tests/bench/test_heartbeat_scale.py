"""What agents' heartbeats cost the control worker at the Alibaba cluster's size (issue 20):
``make bench``, or alone with ``pytest -m bench tests/bench/test_heartbeat_scale.py -s``.

PostgreSQL holds the openb cluster (``tests/bench/openb_fleet.py``: 1,213 hosts, 6,212 GPUs,
filled by the default trace to arrived 100 %). Every host beats with the report of what it
runs, shaped as ``HostReports.owned`` sends it, through the function the control task calls
(``portal.control.tasks.agent_heartbeat``), round the fleet twice: the first round as after
the agents started (their reports complete the database's handles), the second steady, as
every beat after. Measured: the time a beat takes (p50, p99), its statements and writes,
and what one round every ``AGENT_HEARTBEAT_S`` means for one control worker: its cores
busy on beats alone = hosts / interval x the mean beat time. The cycle needs the rest.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean, median
from typing import Any

from django.conf import settings
from django.db import connection

from portal.control import tasks
from portal.fleet.models import Host
from portal.sandboxes.models import Sandbox
from scheduler.bench import write_section
from tests.bench.openb_fleet import OPENB_BENCH, WRITES, percentile, seed_openb

pytestmark = OPENB_BENCH
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:heartbeats:begin -->", "<!-- bench:heartbeats:end -->"


def reports() -> dict[str, list[dict[str, Any]]]:
    """Each host's report of what it runs: every running sandbox, tracked, busy."""
    owned: dict[str, list[dict[str, Any]]] = defaultdict(list)
    rows = Sandbox.objects.filter(state="running").values_list(
        "host__name", "pk", "allocation_key", "started_at", "handle"
    )
    for host, pk, key, started, handle in rows:
        ref = (handle or {}).get("ref", key)
        assert started is not None  # running
        owned[host].append(
            {
                "allocation_id": key, "sandbox_id": pk, "state": "running", "exit_code": None,
                "reason": None, "started_at_ms": int(started.timestamp() * 1000),
                "handle": {"driver": "docker", "allocation_id": key, "sandbox_id": pk, "ref": ref},
                "tracked": True, "util": (55.0, 1.0),
            }
        )  # fmt: skip
    return owned


def beat_round(hosts: list[str], owned: dict[str, list[dict[str, Any]]]) -> tuple[list[float], int, int]:
    """One beat from every host; its times, statements and writes (counted as they run: a
    round's ~10,000 statements overflow the connection's query log)."""
    times: list[float] = []
    counts = {"statements": 0, "writes": 0}

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        counts["statements"] += 1
        counts["writes"] += sql.lstrip().split()[0].upper() in WRITES
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        for host in hosts:
            now_ms = int(time.time() * 1000)
            began = time.perf_counter()
            tasks.agent_heartbeat(host, now_ms, "simulated", "docker", owned.get(host, []), now_ms, None)
            times.append(time.perf_counter() - began)
    return times, counts["statements"], counts["writes"]


def test_heartbeats_at_the_openb_clusters_size(sent_tasks: Any) -> None:
    seeded = seed_openb()
    owned = reports()
    hosts = list(Host.objects.order_by("name").values_list("name", flat=True))
    first = beat_round(hosts, owned)
    steady = beat_round(hosts, owned)
    interval = float(settings.AGENT_HEARTBEAT_S)
    section = render(seeded.hosts, sum(map(len, owned.values())), interval, first, steady)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)


def render(
    hosts: int,
    running: int,
    interval: float,
    first: tuple[list[float], int, int],
    steady: tuple[list[float], int, int],
) -> str:
    def row(name: str, measured: tuple[list[float], int, int]) -> str:
        times, statements, writes = measured
        busy = hosts / interval * mean(times)
        p50, p99 = median(times) * 1000, percentile(times, 0.99) * 1000
        per_beat = f"{statements / len(times):.1f} | {writes / len(times):.1f}"
        return f"| {name} | {len(times):,} | {p50:.1f} | {p99:.1f} | {per_beat} | {busy:.2f} |"

    intro = (
        f"PostgreSQL seeded with the openb cluster ({hosts:,} hosts, {running:,} running sandboxes). Each "
        "host beats once per round with its report of what it runs, through "
        "`portal.control.tasks.agent_heartbeat` (the control task's body; Celery's own cost per "
        "message comes on top). The last column is what one round every "
        f"`AGENT_HEARTBEAT_S` = {interval:g} s costs one control worker: cores busy on beats alone."
    )
    return "\n".join(
        [
            BEGIN,
            "## Heartbeats at the Alibaba cluster's size",
            "",
            textwrap.fill(intro, width=100),
            "",
            "| round | beats | p50 (ms) | p99 (ms) | statements / beat | writes / beat | cores busy |",
            "|---|---:|---:|---:|---:|---:|---:|",
            row("first (after the agents started)", first),
            row("steady", steady),
            "",
            "More than one core busy means a control worker cannot keep up with per-host beats that",
            "carry reports at this size (the twin's many-hosts agent must batch them and keep liveness",
            "out of the task queue); the writes are each beat's host row and one statement for its",
            "sandboxes' utilization windows (an UPDATE per running sandbox before: 7.6 writes a beat).",
            END,
        ]
    )
