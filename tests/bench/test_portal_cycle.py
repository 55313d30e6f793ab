"""One scheduling cycle and the request form's preview at the Alibaba cluster's size
(issue 17): ``make bench``, or alone with ``pytest -m bench tests/bench/test_portal_cycle.py -s``.

PostgreSQL holds the openb cluster (``tests/bench/openb_fleet.py``: 1,213 hosts, 6,212
GPUs, filled by the default trace to arrived 100 %) and 1,000 queued requests. Measured,
through the entry points production uses:

- ``schedule_once`` wall time: the first cycle of a fresh control worker (it warms its
  policy from the database, writes 1,000 first reasons, places what fits), then steady
  cycles in which nothing changed, then cycles with arrivals and departures (before each,
  ``CHURN`` sandboxes stop and ``CHURN`` requests arrive, untimed);
- where each cycle's time went (``scheduling.last_report``);
- the write statements of a cycle in which nothing changed (the goal: none);
- the preview's server time through the Django test client (``POST /sandboxes/preview/``)
  for requests shaped like the waiting ones, answered from the state the last cycle
  published; and, for comparison, a few answered by the database path it falls back to;
  and the whole-GPU ones again naming a GPU model of a menu of three an admin set on their
  tier, which answers for each model of the menu too (issue 40).

Goals: a cycle <= 1.5 s, no write in a cycle that changes nothing, a preview <= 150 ms.
"""

from __future__ import annotations

import os
import random
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.accounts.models import Membership
from portal.catalog.models import Tier
from portal.control import scheduling
from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.scheduling import digest, policy
from scheduler.research.bench_markdown import write_section
from tests.bench.openb_fleet import OPENB_BENCH, WRITES, Seeded, percentile, seed_openb

pytestmark = OPENB_BENCH
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:portal-cycle:begin -->", "<!-- bench:portal-cycle:end -->"
STEADY = 10
CHURN_CYCLES, CHURN = 10, 10
PREVIEWS, AFTER_PUBLICATION, FALLBACK_PREVIEWS = 60, 10, 3
PARTS = ("queue", "snapshot", "fairshare", "learn", "decide", "commit", "encode", "launch", "publish")


def cycle() -> tuple[float, dict[str, float], tuple[int, int]]:
    began = time.perf_counter()
    outcome = scheduling.schedule_once(time.time())
    return time.perf_counter() - began, dict(scheduling.last_report.seconds), outcome


def depart_and_arrive(seeded: Seeded, rng: random.Random) -> None:
    """``CHURN`` running sandboxes end (as their agents report) and ``CHURN`` requests arrive."""
    running = list(Sandbox.objects.filter(state="running").values_list("pk", "allocation_key", "owner_id"))
    users = {u.pk: u for u in seeded.users}
    for pk, key, owner in rng.sample(running, CHURN):
        actions.do_request_stop(pk, users[owner])
        actions.do_mark_stopped(key, timezone.now())
    seeded.enqueue(CHURN)


def preview_forms(seeded: Seeded, count: int, rng: random.Random) -> list[tuple[Any, dict[str, str]]]:
    """Forms for requests shaped like waiting ones, each from a manager of the project; one
    in four a small MPS share (5 % of the threads), which often fits somewhere."""
    waiting = list(
        Sandbox.objects.filter(state="queued").values_list(
            "project_id", "tier_id", "tier__sharing_mode", "gpu_count", "mps_thread_pct", "image_id"
        )
    )
    shares = [row for row in waiting if row[2] == "mps"]
    managers = {m.project_id: m.user for m in Membership.objects.select_related("user")}
    forms = []
    for i in range(count):
        project, tier, mode, gpus, threads, image = rng.choice(shares if i % 4 == 3 else waiting)
        form = {
            "project": str(project), "tier": str(tier), "image": str(image), "isolation": "container",
            "duration_hours": "1",
        }  # fmt: skip
        if mode == "dedicated":
            form["gpu_count"] = str(gpus)
        else:
            form.update(mps_memory_gib="1", mps_thread_pct=str(5 if i % 4 == 3 else threads))
        forms.append((managers[project], form))
    return forms


_clients: dict[int, Client] = {}


def client_for(user: Any) -> Client:
    """A signed-in client whose handler has loaded its middleware (its first request does,
    which no server does per request)."""
    client = _clients.get(user.pk)
    if client is None:
        client = _clients[user.pk] = Client()
        client.force_login(user)
        client.get("/healthz")
    return client


def post_previews(forms: list[tuple[Any, dict[str, str]]]) -> tuple[list[float], list[str]]:
    times, verdicts = [], []
    for user, form in forms:
        client = client_for(user)
        began = time.perf_counter()
        page = client.post("/sandboxes/preview/", form)
        times.append(time.perf_counter() - began)
        assert page.status_code == 200
        text = page.content.decode()
        verdicts.append(next((v for v in ("now", "waits", "refused") if f"verdict-{v}" in text), "?"))
    return times, verdicts


@dataclass
class Figures:
    seeded: Seeded
    seed_s: float = 0.0
    first: tuple[float, dict[str, float], int, int] = (0.0, {}, 0, 0)  # time, split, placed, pending
    steady: list[tuple[float, dict[str, float], int]] = field(default_factory=list)
    churn: list[tuple[float, dict[str, float], int]] = field(default_factory=list)
    statements: int = 0
    writes: int = 0
    state_bytes: int = 0
    preview_s: list[float] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    fallback_s: list[float] = field(default_factory=list)
    menu: list[str] = field(default_factory=list)
    model_s: list[float] = field(default_factory=list)


def test_portal_cycle_at_the_openb_clusters_size(sent_tasks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(42)
    began = time.perf_counter()
    figures = Figures(seed_openb())
    figures.seed_s = time.perf_counter() - began
    policy.forget()  # a control worker that just started

    seconds, split, (placed, pending) = cycle()
    figures.first = (seconds, split, placed, pending)
    for _ in range(STEADY):
        seconds, split, _ = cycle()
        figures.steady.append((seconds, split, 0))
    with CaptureQueriesContext(connection) as queries:
        assert scheduling.schedule_once(time.time())[0] == 0
    # Read now: the list is a view of the connection's log, which each request empties.
    statements = [q["sql"] for q in queries.captured_queries]
    assert statements  # the cycle's reads were seen
    writes = [sql for sql in statements if sql.lstrip().split()[0].upper() in WRITES]
    figures.statements, figures.writes = len(statements), len(writes)
    body = digest._redis().get(digest.BODY_KEY)
    figures.state_bytes = len(body) if isinstance(body, bytes) else 0

    for _ in range(CHURN_CYCLES):
        depart_and_arrive(figures.seeded, rng)
        seconds, split, (churn_placed, _) = cycle()
        figures.churn.append((seconds, split, churn_placed))

    forms = preview_forms(figures.seeded, PREVIEWS + AFTER_PUBLICATION, rng)
    for user, _ in forms:
        client_for(user)
    post_previews(forms[:2])  # the web process decodes the state, its policy scores the fleet
    figures.preview_s, figures.verdicts = post_previews(forms[:PREVIEWS])
    for user, form in forms[PREVIEWS:]:  # each after a new publication, which it decodes
        depart_and_arrive(figures.seeded, rng)
        scheduling.schedule_once(time.time())
        figures.decode_s += post_previews([(user, form)])[0]
    figures.menu, figures.model_s = model_previews(forms[:PREVIEWS])
    monkeypatch.setattr(digest, "max_age_s", lambda: -1.0)  # the control worker is down
    figures.fallback_s, _ = post_previews(forms[:FALLBACK_PREVIEWS])

    section = render(figures)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
    assert writes == []


def model_previews(forms: list[tuple[Any, dict[str, str]]]) -> tuple[list[str], list[float]]:
    """The whole-GPU forms again, each naming a model of a menu of three the admin set on
    their tiers: the request's answer, and one for each model of the menu."""
    menu = sorted(set(Gpu.objects.exclude(model="").values_list("model", flat=True)))[:3]
    Tier.objects.filter(sharing_mode="dedicated").update(gpu_models=menu)
    named = [
        (user, {**form, "gpu_model": menu[i % len(menu)]})
        for i, (user, form) in enumerate(forms)
        if "gpu_count" in form
    ]
    post_previews(named[:1])  # the policy's first scores for the named models' shapes
    times, _ = post_previews(named)
    Tier.objects.filter(sharing_mode="dedicated").update(gpu_models=[])
    return menu, times


def render(f: Figures) -> str:
    seeded = f.seeded
    first_s, first_split, placed, pending = f.first
    steady_s = [s for s, _, _ in f.steady]
    churn_s = [s for s, _, _ in f.churn]

    def cycles(name: str, times: list[float], placed: int) -> str:
        return f"| {name} | {len(times)} | {median(times):.2f} | {percentile(times, 0.99):.2f} | {placed} |"

    def split(name: str, splits: list[dict[str, float]]) -> str:
        cells = [median([s.get(part, 0.0) for s in splits]) * 1000 for part in PARTS]
        return f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |"

    def previews(name: str, times: list[float]) -> str:
        return (
            f"| {name} | {len(times)} | {median(times) * 1000:.0f} | {percentile(times, 0.99) * 1000:.0f} |"
        )

    verdicts = ", ".join(f"{f.verdicts.count(v)} {v}" for v in sorted(set(f.verdicts)))
    intro = (
        f"PostgreSQL seeded with the openb cluster: {seeded.hosts:,} hosts, {seeded.gpus:,} GPUs, filled "
        f"by the default trace (seed 42) to arrived 100 %: {seeded.running:,} running sandboxes with their "
        f"allocations and open usage intervals ({seeded.cpu_only:,} of them CPU-only; every GPU follows "
        f"demand; {seeded.failed} that found no node dropped); and {len(seeded.queued):,} queued requests, "
        "the trace's next pods. The cycle is `schedule_once` as the control worker calls it; the preview is "
        "`POST /sandboxes/preview/` through the Django test client (server time: middleware, form, view, "
        f"template, database, Redis; no network). Seeding took {f.seed_s:.0f} s. Goals: a cycle <= 1.5 s, "
        "no write in a cycle that changes nothing, a preview <= 150 ms."
    )
    return "\n".join(
        [
            BEGIN,
            "## Scheduling cycle and preview in the portal, at the Alibaba cluster's size",
            "",
            textwrap.fill(intro, width=100),
            "",
            "| cycle | cycles | p50 (s) | p99 (s) | placed |",
            "|---|---:|---:|---:|---:|",
            cycles(f"first of a new control worker (learns, {pending:,} first reasons)", [first_s], placed),
            cycles("steady, nothing changed", steady_s, 0),
            cycles(
                f"steady, {CHURN} sandboxes ended and {CHURN} requests came before each",
                churn_s,
                sum(p for _, _, p in f.churn),
            ),
            "",
            "Where a cycle's time goes (ms, median; `scheduling.last_report`): reading the queue, the",
            "fleet and the fair share; teaching the kept policy; `run_cycle`; writing; encoding the",
            "state for the preview; after commit, sending the launches (one transaction) and",
            "publishing the state.",
            "",
            "| cycle | " + " | ".join(PARTS) + " |",
            "|---|" + "---:|" * len(PARTS),
            split("first", [first_split]),
            split("steady, nothing changed", [s for _, s, _ in f.steady]),
            split("steady, with arrivals and departures", [s for _, s, _ in f.churn]),
            "",
            f"A cycle in which nothing changed ran {f.statements} statements, **{f.writes} of them writes**",
            f"(INSERT/UPDATE/DELETE). The state a cycle publishes is {f.state_bytes / 1e6:.1f} MB of JSON.",
            "",
            "| preview | requests | p50 (ms) | p99 (ms) |",
            "|---|---:|---:|---:|",
            previews(f"from the last cycle's state ({verdicts})", f.preview_s),
            previews("the first after a new state (decodes it)", f.decode_s),
            previews("from the database: the state too old (control worker down)", f.fallback_s),
            previews(
                f"naming a model of a tier's menu of {len(f.menu)} ({', '.join(f.menu)}), answered per model",
                f.model_s,
            ),
            END,
        ]
    )
