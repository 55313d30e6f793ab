"""What agents' heartbeats cost the control worker at the Alibaba cluster's size (issue 20):
``make bench``, or alone with ``pytest -m bench tests/bench/test_heartbeat_scale.py -s``.

PostgreSQL holds the openb cluster (``tests/bench/openb_fleet.py``: 1,213 hosts, 6,212 GPUs,
filled by the default trace to arrived 100 %). Every host beats with the report of what it
runs, shaped as ``HostReports.owned`` sends it, through the function the control task calls
(``portal.control.tasks.agent_heartbeats``): one host a call, as real hosts' agents send
them, twice (the first round as after the agents started: their reports complete the
database's handles; the second steady, as every beat after); then all hosts in one call,
as a process serving many simulated hosts sends a round, with reports and without.
Measured: each round's time, statements and writes, and what one round every
``AGENT_HEARTBEAT_S`` means for one control worker: its cores busy on beats alone. The
cycle needs the rest.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from django.conf import settings
from django.db import connection

from portal.control import tasks
from portal.fleet.models import Host
from portal.sandboxes.models import Sandbox
from scheduler.research.bench_markdown import write_section
from tests.bench.openb_fleet import OPENB_BENCH, WRITES, percentile, seed_openb
from wire.liveness import Beat, OwnedSandbox
from workers.host.reports import ReportGate

pytestmark = OPENB_BENCH
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:heartbeats:begin -->", "<!-- bench:heartbeats:end -->"
FULL_REPORT_S = 60.0  # what the twin's agent sets


def reports() -> dict[str, list[OwnedSandbox]]:
    """Each host's report of what it runs: every running sandbox, tracked, busy."""
    owned: dict[str, list[OwnedSandbox]] = defaultdict(list)
    rows = Sandbox.objects.filter(state="running").values_list(
        "host__name", "pk", "allocation_key", "started_at", "handle"
    )
    for host, pk, key, started, handle in rows:
        ref = (handle or {}).get("ref", key)
        assert started is not None  # running
        owned[host].append(
            {
                "allocation_key": key, "sandbox_id": pk, "state": "running", "exit_code": None,
                "reason": None, "started_at_ms": int(started.timestamp() * 1000),
                "handle": {"driver": "docker", "allocation_key": key, "sandbox_id": pk, "ref": ref},
                "tracked": True, "util": (55.0, 1.0),
            }
        )  # fmt: skip
    return owned


@dataclass
class Round:
    name: str
    calls: int
    reports: int
    times: list[float]  # seconds per call
    statements: int
    writes: int
    rounds: int = 1


def beats(hosts: list[str], owned: dict[str, list[OwnedSandbox]] | None) -> list[Beat]:
    now_ms = int(time.time() * 1000)
    return [
        Beat(
            host=host, t_ms=now_ms, backend="simulated", driver="docker",
            owned=None if owned is None else owned.get(host, []), owned_ms=now_ms, alerts_version=None,
        )
        for host in hosts
    ]  # fmt: skip


def beat_round(name: str, calls: list[list[Beat]], rounds: int = 1) -> Round:
    """Every call of one round through the control task's body; its times, statements and
    writes (counted as they run: a round's ~10,000 statements overflow the query log)."""
    times: list[float] = []
    counts = {"statements": 0, "writes": 0}

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        counts["statements"] += 1
        counts["writes"] += sql.lstrip().split()[0].upper() in WRITES
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        for call in calls:
            began = time.perf_counter()
            tasks.agent_heartbeats(call)
            times.append(time.perf_counter() - began)
    reports = sum(beat["owned"] is not None for call in calls for beat in call)
    return Round(name, len(calls), reports, times, counts["statements"], counts["writes"], rounds)


def gated_rounds(hosts: list[str], owned: dict[str, list[OwnedSandbox]], period: float) -> list[list[Beat]]:
    """A minute of rounds, every ``AGENT_HEARTBEAT_S``, from agents whose ``ReportGate`` sends
    a report only when it changed or its full report is due (none changes here: the steady
    state), after the round where every host sent its first."""
    now = [0.0]
    gates = {host: ReportGate(host, period, clock=lambda: now[0]) for host in hosts}
    for host in hosts:
        gates[host].passes(owned.get(host, []))
    calls = []
    for _ in range(int(period / settings.AGENT_HEARTBEAT_S)):
        now[0] += settings.AGENT_HEARTBEAT_S
        call = beats(hosts, None)
        for beat in call:
            if gates[beat["host"]].passes(owned.get(beat["host"], [])):
                beat["owned"] = owned.get(beat["host"], [])
        calls.append(call)
    return calls


def test_heartbeats_at_the_openb_clusters_size(sent_tasks: Any) -> None:
    seeded = seed_openb()
    owned = reports()
    hosts = list(Host.objects.order_by("name").values_list("name", flat=True))
    rounds = [
        beat_round("one host a call, first (after the agents started)", [[b] for b in beats(hosts, owned)]),
        beat_round("one host a call, steady", [[b] for b in beats(hosts, owned)]),
        beat_round("all hosts in one call, every beat with its report", [beats(hosts, owned)]),
        beat_round("all hosts in one call, liveness only", [beats(hosts, None)]),
    ]
    minute = gated_rounds(hosts, owned, FULL_REPORT_S)
    rounds.append(
        beat_round(
            f"all hosts in one call, reports changed or due (`AGENT_FULL_REPORT_S` = {FULL_REPORT_S:g}), "
            "a round's mean over a minute",
            minute,
            rounds=len(minute),
        )
    )
    interval = float(settings.AGENT_HEARTBEAT_S)
    section = render(seeded.hosts, sum(map(len, owned.values())), interval, rounds)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)


def render(hosts: int, running: int, interval: float, rounds: list[Round]) -> str:
    def row(measured: Round) -> str:
        total = sum(measured.times) / measured.rounds
        busy = total / interval  # one round every interval
        per_call = ""
        if measured.calls > measured.rounds:
            p50, p99 = median(measured.times) * 1000, percentile(measured.times, 0.99) * 1000
            per_call = f"{p50:.1f} / {p99:.1f}"
        each = measured.rounds  # figures per round
        cells = [
            measured.name, f"{measured.calls // each:,}", f"{measured.reports // each:,}",
            f"{total * 1000:,.0f}", per_call, f"{measured.statements // each:,}",
            f"{measured.writes // each:,}", f"{busy:.2f}",
        ]  # fmt: skip
        return "| " + " | ".join(cells) + " |"

    intro = (
        f"PostgreSQL seeded with the openb cluster ({hosts:,} hosts, {running:,} running sandboxes). Each "
        "round every host beats once, through `portal.control.tasks.agent_heartbeats` (the control "
        "task's body; Celery's own cost per message comes on top): one host a call, as each real "
        "host's agent sends its beats, or all hosts in one call, as one process serving many "
        "simulated hosts sends a round; a beat's report of what its host runs has the database "
        "reconciled with it. The last column is what one round every "
        f"`AGENT_HEARTBEAT_S` = {interval:g} s costs one control worker: cores busy on beats alone."
    )
    return "\n".join(
        [
            BEGIN,
            "## Heartbeats at the Alibaba cluster's size",
            "",
            textwrap.fill(intro, width=100),
            "",
            "| round | calls | reports | round (ms) | per call p50 / p99 (ms) | statements | writes "
            "| cores busy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *map(row, rounds),
            "",
            "Liveness costs one UPDATE a round once beats come together (and one Redis round trip on",
            "the agent's side); what remains is reconciling reports, which scales with the reports",
            "sent, not the hosts: a process serving many hosts sends a host's report when it changed",
            "and a full one every `AGENT_FULL_REPORT_S` (`workers/host/reports.py`, `ReportGate`),",
            "each host's at its own point of the period. Real hosts' agents send every report.",
            END,
        ]
    )
