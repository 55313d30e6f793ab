"""Load (``make bench``, ``make bench-load USERS=2000``): users with their sandbox pages open,
one in ten also working, against the platform as deployed.

uvicorn with ``LOAD_WEB_WORKERS`` worker processes (deploy's WEB_WORKERS: about one per
core), a control worker, beat and one agent with simulated GPUs whose sandboxes are state
only (the simulated driver: what is measured is the portal, not hundreds of sandbox
processes), against the test database and Redis, with production's sampling, heartbeat and
cycle intervals. Every user has a page of a running sandbox of one of their projects open:
its live chart's WebSocket (tests/bench/telemetry_clients.py, one asyncio process for all)
and its status part's refresh (tests/bench/locustfile.py, locust in its own process: gevent
must not patch this one); one in ten also signs in, browses, requests, extends and stops
sandboxes through the form, the API and the command-line client's API layer.

Run at 100 users and at ``LOAD_USERS`` (both, in one run), ``LOAD_SECONDS`` (300) each after
a warm-up; per route p50/p95/p99 and failures, the sockets' sample ages and losses, each
process's CPU and memory (at the warm-up's end and at the end) and the load average go to
BENCHMARKS.md. Every answer must be the expected one; nothing here asserts a time.
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

pytestmark = [
    pytest.mark.bench,
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    # Set-up, the warm-up, the run (LOAD_SECONDS, 300 by default), the sandboxes' cleanup: past
    # the suite's 300 s per test.
    pytest.mark.timeout(int(os.environ.get("LOAD_SECONDS", "300")) + 2400),
]
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:load:begin -->", "<!-- bench:load:end -->"
PASSWORD = "correct-horse-battery"
MPS_GPUS, TIMESLICE_GPUS = 4, 4  # for the working users: four MPS shares or replicas each
REPLICAS = 4  # time-slice replicas of a GPU (the model's default): watched sandboxes per GPU
USERS = int(os.environ.get("LOAD_USERS", "100"))
SECONDS = int(os.environ.get("LOAD_SECONDS", "300"))
WEB_WORKERS = int(os.environ.get("LOAD_WEB_WORKERS", "2"))
SPAWN_RATE = int(os.environ.get("LOAD_SPAWN_RATE", "20"))
SETTLE_S = 30  # after the last user started, before the window: the first polls spread out
RESULTS: dict[int, dict[str, Any]] = {}  # users -> figures, for the one section of both runs


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
                "session": signed_in(user),
                "projects": [{"slug": p.slug, "id": p.pk} for p in mine],
                "user_id": user.pk,
            }
        )
    return {
        "users": accounts,
        "active": max(1, count // 10),
        "tiers": {slug: catalog[slug].pk for slug in ("mps", "timeslice")},
        "image": {"id": catalog["image"].pk, "name": catalog["image"].name},
    }


def signed_in(user: Any) -> str:
    """A session key for ``user``, as the sign-in form would have made (its password check
    aside: a million PBKDF2 rounds each, 2,000 sign-ins would be minutes of both cores)."""
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY

    session = import_module(settings.SESSION_ENGINE).SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.save()
    return str(session.session_key)


def open_pages(config: dict[str, Any], catalog: dict[str, Any]) -> list[int]:
    """One running time-slice sandbox per project, requested by one of its members: each
    user's open page is one of their first project's. Returns the sandboxes' ids."""
    from django.contrib.auth import get_user_model

    from portal.accounts.models import Project
    from tests.portal.helpers import request

    first_member: dict[int, int] = {}
    for account in config["users"]:
        for project in account["projects"]:
            first_member.setdefault(project["id"], account["user_id"])
    users = get_user_model().objects.in_bulk(list(first_member.values()))
    watched = {}
    for project in Project.objects.filter(pk__in=first_member):
        owner = users[first_member[project.pk]]
        sandbox = request(owner, project, catalog["timeslice"], catalog["image"], "container")
        watched[project.pk] = sandbox.pk
    for account in config["users"]:
        account["watch"] = watched[account["projects"][0]["id"]]
    return list(watched.values())


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


def run_load(users: int, catalog: Any, tmp_path: Path) -> dict[str, Any]:
    """One run at ``users``: set-up, warm-up, LOAD_SECONDS measured; its figures."""
    import redis
    from django.conf import settings

    from portal.fleet.models import Gpu
    from portal.sandboxes.models import Sandbox, SandboxEvent
    from tests.bench.load_figures import ProcessSampler, load_average, socket_figures
    from tests.e2e.platform import database_url

    config = make_users(users, catalog)
    watched_gpus = -(-len({a["projects"][0]["id"] for a in config["users"]}) // REPLICAS)
    gpus = MPS_GPUS + TIMESLICE_GPUS + watched_gpus
    # Production's intervals (the e2e defaults are faster); uvicorn's keep-alive outlasts the
    # users' think time, as nginx's 75 s does for browsers: a request sent on a connection the
    # server is closing that instant fails with no status (a POST is not retried).
    env = {"UVICORN_TIMEOUT_KEEP_ALIVE": "75", "SAMPLE_INTERVAL_MS": "1000", "CYCLE_INTERVAL_S": "2"}
    # CPU and memory for every open page's sandbox (half a core each) and the working users'.
    env["GPUSHARE_SIM_HOST"] = f"cpus={max(64, users)},memory_gib={max(512, users)}"
    spawn_s = users / SPAWN_RATE
    warmup_s = spawn_s + SETTLE_S
    with running_platform(
        tmp_path, web=True, heartbeat_s=5, sim_gpus=f"H100-80GB:{gpus}", driver="simulated",
        extra_env=env, web_workers=WEB_WORKERS,
    ) as platform:  # fmt: skip
        for index in range(gpus):
            mode = "mps" if index < MPS_GPUS else "timeslice"
            Gpu.objects.filter(host__name=platform.host, index=index).update(sharing_mode=mode)
        pages = open_pages(config, catalog)
        wait_for(
            lambda: Sandbox.objects.filter(pk__in=pages, state="running").count() == len(pages),
            300,
            "every open page's sandbox to run",
        )
        credentials = tmp_path / "credentials.json"
        credentials.write_text(json.dumps(config))
        sockets_config = tmp_path / "sockets.json"
        sockets_out = tmp_path / "sockets-out.json"
        sockets_config.write_text(
            json.dumps(
                {
                    "base": f"ws://127.0.0.1:{platform.port}",
                    "origin": f"http://127.0.0.1:{platform.port}",
                    "paths": [f"/ws/sandboxes/{a['watch']}/" for a in config["users"]],
                    "cookies": [f"sessionid={a['session']}" for a in config["users"]],
                    "warmup_s": warmup_s,
                    "duration_s": SECONDS,
                    "drain_s": 3,
                    "out": str(sockets_out),
                }
            )
        )
        run = [sys.executable, "-m", "tests.bench.telemetry_clients", str(sockets_config)]
        sockets = subprocess.Popen(run, cwd=ROOT, stderr=(tmp_path / "sockets.log").open("wb"))
        window_file = sockets_out.with_suffix(".window")
        wait_for(lambda: window_file.exists() or sockets.poll() is not None, 900, "every socket to open")
        argv = [
            sys.executable, "-m", "locust", "-f", str(ROOT / "tests" / "bench" / "locustfile.py"),
            "--headless", "-u", str(users), "-r", str(SPAWN_RATE), "-t", f"{int(warmup_s + SECONDS)}s",
            "--reset-stats", "--stop-timeout", "10", "--host", f"http://127.0.0.1:{platform.port}",
            "--csv", str(tmp_path / "load"), "--only-summary",
        ]  # fmt: skip
        locust_log = tmp_path / "locust.log"
        locust = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "LOAD_CREDENTIALS": str(credentials)},
            stdout=locust_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        named = {name: proc.pid for name, proc in platform.procs.items()}
        named.update(locust=locust.pid, sockets=sockets.pid)
        server: dict[str, Any] = redis.Redis.from_url(settings.REDIS_URL).info("server")  # type: ignore[assignment]  # a sync client
        redis_pid = int(server["process_id"])
        pg = database_url() if database_url().startswith("postgres") else ""
        sampler = ProcessSampler(named, database=pg, redis_pid=redis_pid)
        sampler.start()
        window = json.loads(window_file.read_text()) if window_file.exists() else {"start": 0, "end": 0}
        load_at = {}
        try:
            wait_for(lambda: time.time() >= window["start"], warmup_s + 60, "the warm-up's end", every=1)
            load_at["warm-up end"] = load_average()
            locust.wait(timeout=warmup_s + SECONDS + 120)
            sockets.wait(timeout=120)
            load_at["end"] = load_average()
        finally:
            sampler.stop()
            for proc in (locust, sockets):
                if proc.poll() is None:
                    proc.kill()
            requested = Sandbox.objects.count()
            ran = SandboxEvent.objects.filter(to_state="running").values("sandbox").distinct().count()
            stop_sandboxes(platform)
    routes, total, failures = read_stats(tmp_path / "load")
    log_tail = locust_log.read_text(errors="replace")[-4000:]
    assert int(total["Request Count"]) > 0, log_tail
    return {
        "users": users,
        "gpus": gpus,
        "pages": len(pages),
        "routes": routes,
        "total": total,
        "failures": failures,
        "sockets": socket_figures(json.loads(sockets_out.read_text())) if sockets_out.exists() else {},
        "processes": sampler.over(window["start"], window["end"]),
        "load": load_at,
        "requested": requested,
        "ran": ran,
    }


@pytest.mark.parametrize("users", sorted({100, USERS}))
def test_load(users: int, catalog: Any, tmp_path: Path) -> None:
    RESULTS[users] = result = run_load(users, catalog, tmp_path)
    section = render(RESULTS)
    print(section)
    if os.environ.get("BENCH_OUT") and len(RESULTS) == len({100, USERS}):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
    # Figures first, verdicts after: a run with failures still shows where they were.
    failures = result["failures"]
    assert not failures and result["total"]["Failure Count"] == "0", "\n".join(
        f"{f['Method']} {f['Name']}: {f['Occurrences']} x {f['Error']}" for f in failures
    )
    assert result["sockets"].get("closed", 1) == 0, result["sockets"]


def render(results: dict[int, dict[str, Any]]) -> str:
    scales = sorted(results)
    first = results[scales[0]]
    lines = [
        BEGIN,
        "## Load: thousands of users with their sandbox pages open",
        "",
        f"`make bench-load USERS={scales[-1]}` (tests/bench/test_load.py), each scale for {SECONDS} s after",
        f"a warm-up, on this machine ({os.cpu_count()} cores; PostgreSQL, Redis and the load's own",
        f"processes on the same machine, loopback only): uvicorn with {WEB_WORKERS} worker processes",
        "(WEB_WORKERS), one control worker, beat and one agent with simulated H100s whose sandboxes",
        "are state only; production's sampling (1 s), heartbeat (5 s) and cycle (2 s) intervals.",
        "Every user has a page of a running sandbox of one of their projects open: its live chart's",
        "WebSocket (one asyncio process holds them all) and its status part's 5-minute refresh",
        "(state changes and new timeline lines are pushed on the socket; the page counts the time",
        "left and the cost on itself). One user in ten also signs in through the form, then,",
        "1-5 s apart, browses, requests, extends and stops sandboxes through the form, the API and",
        "the command-line client's API layer (at most two live; the rest of the demand queues) and",
        "reads the API. Times are what the client saw, in ms, from the moment every user had",
        "started (locust rounds to 10 ms above 100 ms); any answer but the expected one is a failure.",
        "",
        "| users | requests/s | failures | sockets | sample age p50 / p99 / max (ms) | lost | closed "
        "| load average (warm-up end; end) |",
        "|---:|---:|---:|---:|---|---:|---:|---|",
    ]  # fmt: skip
    for n in scales:
        r = results[n]
        w = r["sockets"]
        lines.append(
            f"| {n} | {float(r['total']['Requests/s']):.1f} | {r['total']['Failure Count']} | "
            f"{w.get('sockets', 0)} | {w.get('age_p50_ms', 0):.0f} / {w.get('age_p99_ms', 0):.0f} / "
            f"{w.get('age_max_ms', 0):.0f} | {w.get('lost', 0)} | {w.get('closed', 0)} | "
            f"{r['load'].get('warm-up end', '?')}; {r['load'].get('end', '?')} |"
        )
    header = " | ".join(f"{n}: p50 / p95 / p99 (ms) | {n}: requests | {n}: failures" for n in scales)
    lines += ["", f"| method | route | {header} |", "|---|---|" + "---|---:|---:|" * len(scales)]
    keys = sorted({(row["Type"], row["Name"]) for n in scales for row in results[n]["routes"]})
    for method, name in keys:
        cells = []
        for n in scales:
            row = next((x for x in results[n]["routes"] if (x["Type"], x["Name"]) == (method, name)), None)
            times = f"{row['50%']} / {row['95%']} / {row['99%']}" if row else "—"
            cells.append(f"{times} | {row['Request Count']} | {row['Failure Count']}" if row else "— | 0 | 0")
        lines.append(f"| {method} | `{name}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU (percent of one core, over the measured window) and resident memory (MiB: at the",
        "warm-up's end → at the end, most in between) of each process:",
        "",
        "| process | " + " | ".join(f"{n}: CPU % | {n}: RSS MiB" for n in scales) + " |",
        "|---|" + "---:|---|" * len(scales),
    ]
    names = sorted({name for n in scales for name in results[n]["processes"]})
    for name in names:
        cells = []
        for n in scales:
            p = results[n]["processes"].get(name)
            rss = f"{p['rss_start_mib']:.0f} → {p['rss_end_mib']:.0f} ({p['rss_max_mib']:.0f})" if p else ""
            cells.append(f"{p['cpu_pct']:.0f} | {rss}" if p else "— | —")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "; ".join(
            f"{n} users: {results[n]['pages']} open pages' sandboxes on {results[n]['gpus']} GPUs, "
            f"{results[n]['requested']} sandboxes requested in all, {results[n]['ran']} ran"
            for n in scales
        )
        + f". {first['users']}-user figures from the same run.",
        END,
    ]
    return "\n".join(lines)
