"""The openb fleet's cold start (issue 37): ``make bench`` (on PostgreSQL), or alone with
``pytest -m bench tests/bench/test_cold_start.py -s``.

The twin's processes, as ``make twin`` starts them (``portal.twin.cluster.Services``: a
control worker of four threads, beat, and one agent process serving the 1,213 hosts of the
openb node list, 6,212 simulated GPUs), on an empty database and an empty Redis database.
Watched from outside, as the twin's monitor watches a run: when the first and the last
host's first inventory was applied (its host and every GPU in the database), how late the
heartbeats were applied meanwhile (the control worker's own record of each heartbeat
message's lag, ``portal.telemetry.control_figures``), when a heartbeat was again applied
within one ``AGENT_HEARTBEAT_S`` of its sending, and whether any host was marked lost
(watched for ``LOST_WINDOW_S`` after the last inventory: past three missed beats and the
tick that would judge them).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from django.conf import settings
from django.db import connection

from portal.fleet import credentials
from portal.fleet.models import FleetEvent, Host
from portal.telemetry import control_figures
from portal.twin.cluster import Services, cpu_seconds, write_hosts_file
from portal.twin.monitor import fleet_size
from scheduler.research.bench_markdown import write_section
from scheduler.research.trace import load_nodes
from tests.bench.openb_fleet import OPENB_BENCH, TRACES
from wire import signing
from wire.celery import CONTROL_QUEUE

pytestmark = OPENB_BENCH
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:cold-start:begin -->", "<!-- bench:cold-start:end -->"
POLL_S = 0.25
TIMEOUT_S = 600.0
# After the last inventory: three missed beats, and the tick (every CYCLE_INTERVAL_S) that
# marks a silent host lost, with room to spare.
LOST_WINDOW_S = 3 * settings.AGENT_HEARTBEAT_S + 10


# What this bench measured before the first inventories were batched (issue 37), at a load
# average of 18 to 21: kept here, as the section is rewritten by each run.
BEFORE = (
    "Before (issue 37), each host sent its inventory and its start in messages of their own, 2,426 "
    "in all, each applied in its own transaction of 3 statements and 5 more per GPU: from the "
    "first host's inventory to the last took 141.5 s, a heartbeat was current again 259.2 s after "
    "the start, the worst heartbeat lag was 174.4 s and the control queue held 2,311 messages; the "
    "control worker spent 32.5 s of CPU on them (load average 18 to 21). Now a process serving "
    "many hosts sends their inventories a hundred a message (`workers.host.agent.announce`), "
    "applied a batch per transaction in a few bulk statements "
    "(`portal.fleet.inventory.do_sync_inventories`)."
)


@dataclass
class ColdStart:
    """What the watcher saw, in seconds since the processes were started."""

    hosts: int
    gpus: int
    first_s: float | None = None  # the first host's inventory applied
    all_s: float | None = None  # every host and GPU in the database
    current_s: float | None = None  # a heartbeat applied within one interval of its sending
    control_cpu_s: float = 0.0  # the control worker's CPU until every inventory was applied
    longest_queue: int = 0  # messages waiting on the control queue, at most
    lost: int = 0
    lags: list[tuple[float, float]] = field(default_factory=list)  # (applied at s, lag s)
    load: list[float] = field(default_factory=list)  # 1-minute load average, start and end


@pytest.mark.timeout(TIMEOUT_S + LOST_WINDOW_S + 300)  # the test database made and emptied, on a busy machine
def test_cold_start_of_the_openb_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = load_nodes(TRACES / "openb_node_list_gpu_node.csv")
    hosts_file = tmp_path / "hosts.csv"
    write_hosts_file(nodes, hosts_file)
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()  # no message or figure of an earlier run
    # The processes use the test database (pytest-django's) and the suite's Redis database.
    database = urlsplit(os.environ["DATABASE_URL"])
    test_url = urlunsplit(database._replace(path="/" + str(connection.settings_dict["NAME"])))
    monkeypatch.setenv("DATABASE_URL", test_url)
    secret = secrets.token_urlsafe(64)
    monkeypatch.setenv("SECRET_KEY", secret)
    monkeypatch.setenv("DEBUG", "false")
    # Enrolled as the twin enrols its pool; the processes' control key is the new secret's.
    prefix = os.path.commonprefix([n.name for n in nodes])  # noqa: RUF071 - names, not paths
    pool = dataclasses.replace(
        credentials.renew(prefix, pool=True),
        control_public_key=signing.public_text(signing.control_private_key(secret)),
    )
    seen = ColdStart(hosts=len(nodes), gpus=sum(n.gpus for n in nodes), load=[os.getloadavg()[0]])
    services = Services(tmp_path / "logs")
    began, began_ms = time.monotonic(), time.time() * 1000
    services.start(hosts_file, pool=(prefix, pool))
    try:
        watch(services, client, seen, began, began_ms)
    finally:
        services.stop()
    seen.load.append(os.getloadavg()[0])
    seen.lost = FleetEvent.objects.filter(kind="host_lost").count()
    section = render(seen)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
    assert seen.all_s is not None, f"the fleet did not come up: {fleet_size()} of ({seen.hosts}, {seen.gpus})"


def watch(services: Services, client: redis.Redis, seen: ColdStart, began: float, began_ms: float) -> None:
    """Poll until every inventory is applied, a heartbeat is current and ``LOST_WINDOW_S``
    passed; or until the timeout, or a process died."""
    interval_ms = settings.AGENT_HEARTBEAT_S * 1000
    while (now := time.monotonic() - began) < TIMEOUT_S:
        if dead := services.dead():
            raise AssertionError(f"a process exited during the cold start: {', '.join(dead)}")
        seen.longest_queue = max(seen.longest_queue, int(cast(int, client.llen(CONTROL_QUEUE))))
        seen.lost = max(seen.lost, Host.objects.filter(state=Host.State.LOST).count())
        hosts, gpus = fleet_size()
        if hosts and seen.first_s is None:
            seen.first_s = now
        if seen.all_s is None and (hosts, gpus) == (seen.hosts, seen.gpus):
            seen.all_s = now
            seen.control_cpu_s = cpu_seconds(services.pid("control"))
        if seen.all_s is not None:
            lags = control_figures.read(client, control_figures.HEARTBEAT_LAG)
            seen.lags = sorted(((at - began_ms) / 1000, lag / 1000) for at, lag in lags)
            current = [at for at, lag in seen.lags if at >= seen.all_s and lag * 1000 <= interval_ms]
            if current and seen.current_s is None:
                seen.current_s = current[0]
            if seen.current_s is not None and now - seen.all_s >= LOST_WINDOW_S:
                return
        time.sleep(POLL_S)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def render(seen: ColdStart) -> str:
    up_to = seen.current_s if seen.current_s is not None else float("inf")
    while_coming_up = [lag for at, lag in seen.lags if at <= up_to]
    first_to_all = None if seen.first_s is None or seen.all_s is None else seen.all_s - seen.first_s
    rows: list[tuple[str, Any]] = [
        ("processes started → the first host's inventory applied (Celery, Django, the pool built)",
         _s(seen.first_s)),
        ("the first host's inventory applied → every host's (all hosts and GPUs in the database)",
         _s(first_to_all)),
        ("processes started → every host's first inventory applied", _s(seen.all_s)),
        (f"processes started → a heartbeat applied within `AGENT_HEARTBEAT_S` = "
         f"{settings.AGENT_HEARTBEAT_S} s of its sending", _s(seen.current_s)),
        ("heartbeat lag until then, worst (s)", _s(max(while_coming_up, default=None))),
        ("heartbeat messages applied until then", len(while_coming_up)),
        ("control queue, longest (messages)", f"{seen.longest_queue:,}"),
        ("control worker CPU until every inventory was applied (s)", f"{seen.control_cpu_s:.1f}"),
        (f"hosts lost (watched {LOST_WINDOW_S:g} s past the last inventory)", seen.lost),
    ]  # fmt: skip
    intro = (
        f"The twin's processes (`portal/twin/cluster.py`: a control worker of 4 threads, beat, one agent "
        f"process serving {seen.hosts:,} simulated hosts with {seen.gpus:,} GPUs) started on an empty "
        "PostgreSQL database and Redis database, watched from outside every "
        f"{POLL_S:g} s. Load average of this 2-core machine (shared) at the start and end: "
        f"{seen.load[0]:.1f}, {seen.load[-1]:.1f}."
    )
    return "\n".join(
        [
            BEGIN,
            "## The openb fleet's cold start",
            "",
            textwrap.fill(intro, width=100),
            "",
            "| | s or count |",
            "|---|---:|",
            *(f"| {name} | {value} |" for name, value in rows),
            "",
            textwrap.fill(BEFORE, width=100),
            END,
        ]
    )
