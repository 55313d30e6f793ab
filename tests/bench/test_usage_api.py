"""``GET /api/v1/usage/`` over 1,000,000 usage records (``make bench``).

The records are written by one ``INSERT … SELECT generate_series`` (seconds, not the hours
the ORM would take), spread over 20 projects, 40 users, 4 tiers and 12 months. Each page is
timed through the Django test client with an API token (authentication, permission,
filters, cursor pagination, serialisation, the database; no network): the first page, then
cursor pages followed 50 deep, plain and with each filter. Goal: p95 per page ≤ 100 ms.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from portal.accounts.models import ApiToken
from scheduler.research.bench_markdown import write_section
from tests.factories import MembershipFactory, ProjectFactory, UserFactory
from tests.portal.helpers import request

pytestmark = [pytest.mark.bench, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:usage-api:begin -->", "<!-- bench:usage-api:end -->"
RECORDS = int(os.environ.get("USAGE_BENCH_RECORDS", "1000000"))
PAGES = 50  # cursor pages followed per query
PROJECTS, USERS = 20, 40


def _fill(people: Any, catalog: Any) -> dict[str, Any]:
    """1,000,000 closed usage records of 200 sandboxes, written in SQL."""
    projects = [people["project"]] + [ProjectFactory(slug=f"lab-{i:02d}") for i in range(PROJECTS - 1)]
    users: list[Any] = [UserFactory(username=f"user-{i:02d}") for i in range(USERS)]
    for i, user in enumerate(users):
        MembershipFactory(user=user, project=projects[i % PROJECTS], role="member")
    tiers = [catalog[k] for k in ("dedicated", "mig", "mps", "timeslice")]
    sandboxes = [
        request(people["owner"], people["project"], catalog["dedicated"], catalog["image"]).pk
        for i in range(200)
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO billing_usagerecord (sandbox_id, allocation_key, project_id, user_id, tier_id,
                gpu_model, milli_gpu, price_per_gpu_hour_micros, currency, started_at, ended_at,
                duration, cost_micros)
            SELECT (%(sandboxes)s::bigint[])[1 + n %% 200],
                   'bench-' || n,
                   (%(projects)s::bigint[])[1 + n %% %(p)s],
                   (%(users)s::bigint[])[1 + n %% %(u)s],
                   (%(tiers)s::bigint[])[1 + n %% 4],
                   'H100-80GB', 1000, 2500000, 'EUR',
                   TIMESTAMPTZ '2025-11-01' + n * INTERVAL '31 seconds',
                   TIMESTAMPTZ '2025-11-01' + n * INTERVAL '31 seconds' + INTERVAL '30 minutes',
                   INTERVAL '30 minutes', 1250000
            FROM generate_series(1, %(n)s) AS n
            """,
            {
                "sandboxes": sandboxes,
                "projects": [p.pk for p in projects],
                "users": [u.pk for u in users],
                "tiers": [t.pk for t in tiers],
                "p": PROJECTS,
                "u": USERS,
                "n": RECORDS,
            },
        )
        cursor.execute("ANALYZE billing_usagerecord")
    return {"projects": projects, "users": users, "tiers": tiers}


def _walk(client: Client, token: str, query: str) -> list[float]:
    """Milliseconds per page: the first, then PAGES-1 cursor pages."""
    times, url = [], f"/api/v1/usage/?{query}"
    for _ in range(PAGES):
        started = time.perf_counter()
        response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.content[:300]
        body = response.json()
        assert body["results"], query
        if not body.get("next"):
            break
        url = body["next"].split("testserver", 1)[-1]
    return times


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_usage_api_over_a_million_records(people: Any, catalog: Any, sent_tasks: Any) -> None:
    started = time.perf_counter()
    world = _fill(people, catalog)
    fill_s = time.perf_counter() - started
    admin = people["admin"]
    _, token = ApiToken.issue(admin, "bench", ["read:usage", "admin"])
    client = Client()
    queries = {
        "all (staff token)": "",
        "one project": f"project={world['projects'][3].slug}",
        "one user": f"user={world['users'][5].username}",
        "one tier": f"tier={world['tiers'][1].slug}",
        "one month": "start=2026-03-01T00:00:00Z&end=2026-04-01T00:00:00Z",
        "project + month": f"project={world['projects'][7].slug}&start=2026-06-01T00:00:00Z"
        "&end=2026-07-01T00:00:00Z",
    }
    _walk(client, token, "")  # warm-up: connections, caches, the query plans
    rows = []
    every: list[float] = []
    for name, query in queries.items():
        times = _walk(client, token, query)
        every += times
        rows.append((name, query, len(times), statistics.median(times), _pct(times, 0.95), max(times)))
    lines = [
        BEGIN,
        "## Usage API over 1,000,000 records",
        "",
        f"`GET /api/v1/usage/` with an API token over {RECORDS:,} closed usage records (20 projects,",
        f"40 users, 4 tiers, 12 months) in PostgreSQL, written in {fill_s:.0f} s. Default page size (100);",
        f"the first page, then up to {PAGES - 1} cursor pages followed, through the Django test client",
        "(no network). Goal: p95 per page ≤ 100 ms.",
        "",
        "| query | pages | p50 (ms) | p95 (ms) | max (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, query, pages, p50, p95, top in rows:
        lines.append(f"| {name} (`{query or '—'}`) | {pages} | {p50:.1f} | {p95:.1f} | {top:.1f} |")
    summary = (len(every), statistics.median(every), _pct(every, 0.95), max(every))
    lines.append("| **every page** | {} | {:.1f} | {:.1f} | {:.1f} |".format(*summary))
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
