"""A burst of requests (``make bench``): 100 CPU-only batch containers asked for at once.

The platform is what ``make run`` starts (``python -m portal.launcher``: migrate, the demo
seed, both demo agents' self-tests, then uvicorn, a control worker, an agent per demo host
and beat), once on the embedded default (SQLite, the embedded Redis) and once on
PostgreSQL and Redis. As an operator would, the bench raises the demo project's quota to
let 100 sandboxes live at once; alice then sends 100 ``POST /api/v1/sandboxes/`` at once
with an API token. The demo's two hosts are sized as the four-GPU servers they simulate
(portal/demo.py): together they hold 128 two-core CPU sandboxes, so the whole burst at once.

Figures: each POST's answer time, and each sandbox's ``running`` event (written by the
platform) after the burst began and after its own ``requested`` event. Nothing here
asserts a time; results go to BENCHMARKS.md. ``BURST_SIZE`` and ``BURST_COMMAND`` change
the burst; ``BURST_DATABASE_URL``/``BURST_REDIS_URL`` name the PostgreSQL database (made
afresh) and Redis database the second run uses.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from scheduler.research.bench_markdown import write_section
from tests.e2e.make_run import Launcher
from tests.e2e.platform import wait_for
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.bench, pytest.mark.e2e, pytest.mark.docker, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:burst:begin -->", "<!-- bench:burst:end -->"
SIZE = int(os.environ.get("BURST_SIZE", "100"))
COMMAND = os.environ.get("BURST_COMMAND", "true")
DATABASE_URL = os.environ.get("BURST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare_burst")
REDIS_URL = os.environ.get("BURST_REDIS_URL", "redis://127.0.0.1:6379/13")
RESULTS: dict[str, dict[str, Any]] = {}
# The operator's part: the demo project may hold the whole burst at once (default quota: 10).
SETUP = f"""
from django.contrib.auth.models import User
from portal.accounts.models import ApiToken
from portal.quotas.models import QuotaPolicy
QuotaPolicy.objects.filter(project__slug="vision-lab").update(max_live_sandboxes={SIZE})
print(ApiToken.issue(User.objects.get(username="alice"), "burst", ["write:sandboxes", "read:usage"])[1])
"""
EVENTS = """
import json, sys
from portal.sandboxes.models import SandboxEvent
ids = json.loads(sys.stdin.read())
rows = SandboxEvent.objects.filter(sandbox_id__in=ids).values_list("sandbox_id", "to_state", "at")
print(json.dumps([[pk, state, at.timestamp()] for pk, state, at in rows]))
"""


def agents_up(platform: Launcher) -> bool:
    agents = (platform.healthz() or {}).get("checks", {}).get("agents", {})
    return len(agents) == 2 and all(a["ok"] for a in agents.values())


@contextmanager
def make_run(tmp_path: Path, servers: dict[str, str]) -> Iterator[Launcher]:
    platform = Launcher(tmp_path / "var", tmp_path / "make-run.log", driver="docker", servers=servers)
    began = time.time()
    platform.start()
    try:
        wait_for(lambda: agents_up(platform), 300, lambda: f"agents: {platform.output()[-3000:]}", every=1)
        yield platform
    finally:
        try:
            platform.stop()
        finally:
            platform.kill()  # one that did not stop in time
            remove_burst_containers(began)


def remove_burst_containers(began: float) -> None:
    """The demo agents' containers made since this run began (sandboxes outlive agents on
    purpose); another ``make run`` on this machine may have its own under the same names."""
    import docker

    from portal.demo import DEMO_HOSTS

    client = docker.from_env()
    for container in client.containers.list(all=True, filters={"label": "io.gpushare.host"}):
        created = datetime.fromisoformat(container.attrs["Created"][:26].rstrip("Z") + "+00:00")
        if container.labels.get("io.gpushare.host") in DEMO_HOSTS and created.timestamp() >= began:
            container.remove(force=True)


def demo_room() -> int:
    """CPU-only sandboxes the demo hosts hold at once."""
    from portal.console.management.commands.seed_demo import HOST_SHARE
    from portal.demo import DEMO_HOST_SIZE, DEMO_HOSTS

    size = dict(item.split("=") for item in DEMO_HOST_SIZE.split(","))
    cores, memory_mib = HOST_SHARE["cpu"]
    each = min(int(size["cpus"]) // cores, int(size["memory_gib"]) * 1024 // memory_mib)
    return int(each) * len(DEMO_HOSTS)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def burst(platform: Launcher) -> dict[str, Any]:
    key = platform.manage(SETUP).splitlines()[-1]
    body = {"project": "vision-lab", "tier": "cpu", "image": "busybox", "isolation": "container",
            "run": "batch", "command": COMMAND, "duration_hours": 1}  # fmt: skip

    def post(_: int) -> tuple[float, int, Any]:
        sent = time.monotonic()
        code, answer = platform.answer("/api/v1/sandboxes/", key, body)
        return time.monotonic() - sent, code, answer

    began = time.time()
    with ThreadPoolExecutor(max_workers=SIZE) as pool:
        answers = list(pool.map(post, range(SIZE)))
    refused = [(code, answer) for _, code, answer in answers if code != 201]
    assert not refused, refused[:3]
    ids = [answer["id"] for _, _, answer in answers]

    def ran() -> list[list[Any]] | None:
        rows = json.loads(platform.manage(EVENTS, json.dumps(ids)).splitlines()[-1])
        return rows if len({pk for pk, state, _ in rows if state == "running"}) == SIZE else None

    rows = wait_for(ran, 600, lambda: f"all {SIZE} to run: " + platform.output()[-3000:], every=2)
    first: dict[tuple[int, str], float] = {}
    for pk, state, at in rows:
        first.setdefault((pk, state), at)
    from_burst = [first[pk, "running"] - began for pk in ids]
    from_request = [first[pk, "running"] - first[pk, "requested"] for pk in ids]
    return {
        "post": [seconds for seconds, _, _ in answers],
        "from_burst": from_burst,
        "from_request": from_request,
    }


def measure(name: str, tmp_path: Path, servers: dict[str, str]) -> None:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    with make_run(tmp_path, servers) as platform:
        load = os.getloadavg()[0]
        figures = burst(platform) | {"load": load}
    RESULTS[name] = figures
    print(
        f"{name}: running after the burst began p50 {statistics.median(figures['from_burst']):.2f} s, "
        f"p99 {percentile(figures['from_burst'], 0.99):.2f} s, max {max(figures['from_burst']):.2f} s; "
        f"requested->running p50 {statistics.median(figures['from_request']):.2f} s, "
        f"p99 {percentile(figures['from_request'], 0.99):.2f} s; "
        f"POST p50 {statistics.median(figures['post']):.2f} s, p99 {percentile(figures['post'], 0.99):.2f} s"
    )


def test_the_engine_alone() -> None:
    """The floor under the platform's figure: the docker driver alone starting the burst's
    containers (same arguments, same image and command) from as many threads as the demo's
    agents have together, on this machine at this moment; no portal, no messages."""
    from wire.spec import SandboxSpec
    from workers.drivers.docker import DockerDriver, docker_available

    require_engine(docker_available(), "a Docker engine")
    from portal.demo import DEMO_HOSTS
    from portal.launcher import AGENT_THREADS

    driver = DockerDriver(host=f"burst-{uuid.uuid4().hex[:6]}")
    specs = [
        SandboxSpec(
            allocation_key=f"burst{uuid.uuid4().hex[:12]}",
            sandbox_id=i,
            host=driver.host,
            project="burst",
            owner="alice",
            image="gpushare/sandbox-base:1",
            command=tuple(shlex.split(COMMAND)),
            device_uuids=(),
            real_gpu=False,
            cpu_limit=2.0,
            memory_limit_mib=2048,
            pids_limit=256,
        )
        for i in range(SIZE)
    ]
    threads = AGENT_THREADS * len(DEMO_HOSTS)
    load = os.getloadavg()[0]
    began = time.time()
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            handles = list(pool.map(driver.launch, specs))
        started = [(driver.status(handle).started_at_ms or 0) / 1000 - began for handle in handles]
    finally:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda handle: driver.stop(handle, grace_s=0), driver.list_owned()))
    RESULTS["the docker driver alone"] = {"from_burst": started, "threads": threads, "load": load}
    print(
        f"the docker driver alone, {threads} threads: started p50 {statistics.median(started):.2f} s, "
        f"p99 {percentile(started, 0.99):.2f} s, max {max(started):.2f} s after the first launch"
    )


def test_embedded_default(tmp_path: Path) -> None:
    measure("embedded (SQLite, embedded Redis)", tmp_path, {})


def test_postgresql(tmp_path: Path) -> None:
    import psycopg

    server, _, name = DATABASE_URL.rpartition("/")
    try:
        with psycopg.connect(f"{server}/postgres", autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        require_engine(False, f"PostgreSQL at {server} ({exc})")
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    measure("PostgreSQL and Redis", tmp_path, {"DATABASE_URL": DATABASE_URL, "REDIS_URL": REDIS_URL})


def test_write_section() -> None:
    """Runs last in this module: renders what the tests above measured."""
    if not RESULTS:
        pytest.skip("nothing measured")
    lines = [
        BEGIN,
        "## A burst of requests",
        "",
        f"{SIZE} CPU-only batch containers (`--command {COMMAND}`) asked for at once through",
        f"`POST /api/v1/sandboxes/` ({SIZE} connections, one API token) against what `make run`",
        "starts: the launcher's uvicorn, control worker, beat and two demo agents (docker driver),",
        f"the demo project's quota raised to {SIZE} live sandboxes. The two hosts, sized as the",
        f"four-GPU servers they simulate (portal/demo.py), hold {demo_room()} such sandboxes (2 cores",
        "each) at once.",
        "*Running* is the sandbox's `running` event; *the docker driver alone* starts the same",
        "containers from as many threads as the two agents have, with no portal: the engine's",
        "floor on this machine at that moment. Measured by `make bench` (`pytest -m bench",
        f"tests/bench/test_burst.py`) on the development machine ({os.cpu_count()} cores, shared",
        "with other work: the 1-minute load average at the start of each row is beside it).",
        "Target: p99 ≤ 5 s.",
        "",
        "| deployment | load | running after the burst p50 / p99 / max (s) | requested → running "
        "p50 / p99 (s) | POST p50 / p99 (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, f in RESULTS.items():
        burst_s = f["from_burst"]
        if "post" not in f:  # the floor: containers started, no requests
            lines.append(
                f"| {name} ({f['threads']} threads) | {f['load']:.0f} | {statistics.median(burst_s):.2f} / "
                f"{percentile(burst_s, 0.99):.2f} / {max(burst_s):.2f} | - | - |"
            )
            continue
        request_s, post_s = f["from_request"], f["post"]
        lines.append(
            f"| {name} | {f['load']:.0f} | {statistics.median(burst_s):.2f} / "
            f"{percentile(burst_s, 0.99):.2f} / {max(burst_s):.2f} | {statistics.median(request_s):.2f} / "
            f"{percentile(request_s, 0.99):.2f} | {statistics.median(post_s):.2f} / "
            f"{percentile(post_s, 0.99):.2f} |"
        )
    lines += [
        "",
        "Where the time goes (the events' times, embedded default): the requests are accepted",
        "one after another in one web process (16 queries each; 23 before the second round of",
        "changes below); a cycle places what fits within about a second of each request",
        "(requests ask for one, debounced); then each launch waits its turn at the Docker",
        "engine, which on two cores starts a few containers a second however many threads ask:",
        "while the engine alone (the first row) needs more than 5 s for 100, so does the",
        "platform, whatever it does. Of the engine's time a create is ~15 ms and a start ~200 ms",
        "(60 containers from 32 threads at load 27: creates 0.9 s, starts 12.4 s); about 30 % of",
        "a start is the container's own network namespace, which a `network_mode=none` sandbox",
        "still gets and must keep (the host's or a shared one would give tenants each other's",
        "loopback). Debian's `crun` runtime, faster than `runc` elsewhere, refuses to start",
        "anything on this machine's hybrid cgroup v1 (`cgroups in hybrid mode not supported`),",
        "so it is not set up. The first round of changes (4 task threads per agent, every",
        "heartbeat's report inspecting each container twice, an ended batch reported with the",
        "beat after the one that listed it): running after the burst p50 26.0 s, p99 46.5 s to",
        "11.6 / 20.0 s (embedded, quiet machine). The second: the demo hosts sized as the servers",
        "they simulate (64 sandboxes fitted at once, and the queued 36 waited for the room of",
        "ended batches), a launch without inspecting what it made, a stop without inspecting",
        "first, a batch's output read without an inspection each tick, a token's last use",
        "written once a minute, and the request's rows read once.",
        "Measured back to back at loads 12 to 23 (others' load tests running), before and after",
        "the second round: embedded p50 / p99 19.3 / 33.8 s and 23.0 / 33.7 s, PostgreSQL",
        "24.7 / 40.1 s and 24.9 / 36.5 s, the engine alone 19.4 and 20.0 s p99: within this",
        "machine's noise the platform follows the engine, 14 to 16 s behind its floor, where the",
        "engine starts the platform's containers slower than alone (their engine start times",
        "p99 30 to 50 s), sharing two cores with the web, control and agent processes and",
        "answering the agents' reports, output reads and stops too.",
        "On PostgreSQL,",
        "100 requests at once need the web process's connection pool (`DB_POOL_MAX_SIZE`):",
        "with a connection per request thread they opened ~80 and PostgreSQL's 100 ran out",
        "(500s, in 3 runs of 4 without the pool).",
    ]
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
