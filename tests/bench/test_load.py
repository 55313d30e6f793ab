"""Load (``make bench``): simulated users browse and request sandboxes against the real platform.

One uvicorn process, one control worker and one agent with simulated GPUs (sandboxes are
real bubblewrap processes) run against the test database, as in the e2e tests; locust
runs tests/bench/locustfile.py in another process (gevent must not patch this one) on
loopback. Every answer must be the expected one; p50 and p95 per route go to BENCHMARKS.md.
``LOAD_USERS`` (100) and ``LOAD_SECONDS`` (300) make a shorter run for development.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.research.bench_markdown import write_section
from tests.e2e.platform import Platform, running_platform, wait_for
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.bench,
    pytest.mark.e2e,
    pytest.mark.bwrap,
    pytest.mark.django_db(transaction=True),
    # Set-up, the run (LOAD_SECONDS, 300 by default), the sandboxes' cleanup: past the suite's
    # 300 s per test.
    pytest.mark.timeout(int(os.environ.get("LOAD_SECONDS", "300")) + 900),
]
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:load:begin -->", "<!-- bench:load:end -->"
PASSWORD = "correct-horse-battery"
MPS_GPUS, TIMESLICE_GPUS = 4, 4  # four MPS shares or four time-slice replicas each: 32 at once


def make_users(count: int, catalog: dict[str, Any]) -> dict[str, Any]:
    """``count`` users, each a member of 2 to 4 of ``count // 10`` projects (at least 4),
    with a password and an API token; every project's quota far above what the users ask."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password

    from portal.accounts.models import ApiToken, Membership, Project
    from portal.quotas.models import QuotaPolicy

    rng = random.Random(8)
    projects = Project.objects.bulk_create(
        Project(slug=f"team-{i}", name=f"Team {i}") for i in range(max(4, count // 10))
    )
    QuotaPolicy.objects.bulk_create(
        QuotaPolicy(project=p, max_live_sandboxes=10_000, max_gpus=1_000) for p in projects
    )
    hashed = make_password(PASSWORD)  # one hash: a million PBKDF2 rounds per user would take minutes
    users = get_user_model().objects.bulk_create(
        get_user_model()(username=f"load{i:03d}", email=f"load{i:03d}@example.org", password=hashed)
        for i in range(count)
    )
    accounts = []
    for user in users:
        mine = rng.sample(projects, rng.randint(2, 4))
        Membership.objects.bulk_create(Membership(user=user, project=p, role="member") for p in mine)
        _, key = ApiToken.issue(user, "load", ["read:usage", "write:sandboxes"])
        accounts.append(
            {
                "username": user.username,
                "password": PASSWORD,
                "token": key,
                "projects": [{"slug": p.slug, "id": p.pk} for p in mine],
            }
        )
    return {
        "users": accounts,
        "tiers": {slug: catalog[slug].pk for slug in ("mps", "timeslice")},
        "image": {"id": catalog["image"].pk, "name": catalog["image"].name},
    }


def cpu_seconds(platform: Platform) -> dict[str, float]:
    """User + system CPU of each platform process so far (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for name, proc in platform.procs.items():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        times[name] = (int(fields[11]) + int(fields[12])) / tick
    return times


def stop_sandboxes(platform: Platform) -> None:
    """Stop what the users left running: process sandboxes outlive their agent by design."""
    from portal.sandboxes import actions
    from portal.sandboxes.models import LIVE_STATES, Sandbox

    for pk in Sandbox.objects.filter(state__in=LIVE_STATES).values_list("pk", flat=True):
        actions.do_request_stop(pk, None, reason="load test over")
    try:
        wait_for(lambda: not Sandbox.objects.filter(state__in=LIVE_STATES).exists(), 180, "sandboxes to stop")
    finally:
        for handle in Sandbox.objects.exclude(handle=None).values_list("handle", flat=True):
            if handle and handle.get("driver") == "process":
                with contextlib.suppress(OSError, ValueError):
                    os.killpg(int(handle["ref"]), signal.SIGKILL)


def read_stats(prefix: Path) -> tuple[list[dict[str, str]], dict[str, str], list[dict[str, str]]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(f"{prefix}_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    routes = sorted((r for r in rows if r["Name"] != "Aggregated"), key=lambda r: (r["Name"], r["Type"]))
    return routes, total, failures


def test_load(catalog: Any, tmp_path: Path) -> None:
    from portal.fleet.models import Gpu
    from portal.sandboxes.models import Sandbox, SandboxEvent
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    users = int(os.environ.get("LOAD_USERS", "100"))
    seconds = int(os.environ.get("LOAD_SECONDS", "300"))
    # Each sign-in hashes the password (PBKDF2, a million rounds: about 0.3 s of a core), and
    # a request holds its database connection throughout: 100 sign-ins within 10 s on two
    # cores would hold most of PostgreSQL's 100 connections at once.
    rate = os.environ.get("LOAD_SPAWN_RATE", "2")
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps(make_users(users, catalog)))
    gpus = MPS_GPUS + TIMESLICE_GPUS
    # uvicorn closes a connection idle 5 s by default, while a user thinks 1-5 s: a request
    # sent on a connection the server is closing that instant fails with no status (a POST is
    # not retried). Browsers reach uvicorn through nginx, which opens its own connections;
    # here the keep-alive outlasts the think time, as nginx's 75 s does for browsers.
    keep_alive = {"UVICORN_TIMEOUT_KEEP_ALIVE": "75"}
    with running_platform(
        tmp_path, web=True, sim_gpus=f"H100-80GB:{gpus}", driver="process", extra_env=keep_alive
    ) as platform:
        for index in range(gpus):
            mode = "mps" if index < MPS_GPUS else "timeslice"
            Gpu.objects.filter(host__name=platform.host, index=index).update(sharing_mode=mode)
        before, started = cpu_seconds(platform), time.monotonic()
        argv = [
            sys.executable, "-m", "locust", "-f", str(ROOT / "tests" / "bench" / "locustfile.py"),
            "--headless", "-u", str(users), "-r", rate, "-t", f"{seconds}s", "--stop-timeout", "10",
            "--host", f"http://127.0.0.1:{platform.port}", "--csv", str(tmp_path / "load"), "--only-summary",
        ]  # fmt: skip
        try:
            locust = subprocess.run(
                argv,
                cwd=ROOT,
                env={**os.environ, "LOAD_CREDENTIALS": str(credentials)},
                capture_output=True,
                text=True,
                timeout=seconds + 120,
            )
            wall = time.monotonic() - started
            after = cpu_seconds(platform)
            requested = Sandbox.objects.count()
            ran = SandboxEvent.objects.filter(to_state="running").values("sandbox").distinct().count()
        finally:
            stop_sandboxes(platform)
    routes, total, failures = read_stats(tmp_path / "load")
    assert not failures and total["Failure Count"] == "0", (
        "\n".join(f"{f['Method']} {f['Name']}: {f['Occurrences']} x {f['Error']}" for f in failures)
        + "\n"
        + locust.stderr[-4000:]
    )
    assert int(total["Request Count"]) > 0, locust.stderr[-4000:]

    cpu = {name: (after[name] - before.get(name, 0.0)) / wall * 100 for name in after}
    lines = [
        BEGIN,
        "## Load: simulated users against the platform",
        "",
        f"{users} users (locust, in its own process; started {rate} a second) for {seconds} s against the",
        f"platform on this machine ({os.cpu_count()} cores, PostgreSQL and Redis on the same machine,",
        "loopback only): one uvicorn process, one control worker and one agent with",
        f"{gpus} simulated H100s ({MPS_GPUS} MPS, {TIMESLICE_GPUS} time-sliced: 32 sandboxes at once;",
        "sandboxes are bubblewrap processes). Each user signs in through the login form, then, 1-5 s apart,",
        "browses the pages (with their htmx refreshes and the request form's preview), requests",
        "sandboxes through the form or the API (at most two live; the rest of the fleet's demand",
        "queues), stops them through the form or the API, and reads the API. Times are what the",
        "client saw, in ms (rounded as locust records them: to 10 ms above 100 ms, to 100 ms above 1 s);",
        "any answer other than the expected status counts as a failure.",
        f"{requested} sandboxes were requested and {ran} of them ran; platform CPU (percent of one",
        "core): " + ", ".join(f"{name} {pct:.0f} %" for name, pct in sorted(cpu.items())) + ".",
        "",
        "| method | route | requests | p50 (ms) | p95 (ms) | max (ms) | failures |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in [*routes, {**total, "Type": "", "Name": ""}]:
        route = f"`{row['Name']}`" if row["Name"] else "all"
        lines.append(
            f"| {row['Type']} | {route} | {row['Request Count']} | {row['50%']} | {row['95%']} | "
            f"{float(row['Max Response Time']):.0f} | {row['Failure Count']} |"
        )
    lines += ["", f"{float(total['Requests/s']):.1f} requests/s in all.", END]
    section = "\n".join(lines)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
