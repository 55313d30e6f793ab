"""Server time of every page at scale (``make bench``): 200 GPUs, 1,000 sandboxes.

The Django test client runs the whole request (middleware, views, templates, the
database) in this process, so the time is the server's, without a network or a browser.
Results go to BENCHMARKS.md; the query bounds are asserted by tests/portal/test_page_budget.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from scheduler.research.bench_markdown import write_section
from tests.portal.scale import GPUS_PER_HOST, HOSTS, SANDBOXES
from tests.portal.test_page_budget import measure

pytestmark = [pytest.mark.bench, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench:pages:begin -->", "<!-- bench:pages:end -->"


def test_page_times(people: Any, catalog: Any, sent_tasks: Any) -> None:
    results = measure(people, catalog)
    lines = [
        BEGIN,
        "## Portal pages at scale",
        "",
        f"{HOSTS * GPUS_PER_HOST} GPUs on {HOSTS} hosts and {SANDBOXES:,} sandboxes (150 running, 50 queued,",
        "the rest ended, with their events, usage and notifications) in PostgreSQL. Server time of one",
        "request after a warm-up, through the Django test client (middleware, view, template, database;",
        "no network). Target: ≤ 300 ms each; the query counts are asserted by",
        "`tests/portal/test_page_budget.py`.",
        "",
        "| as | request | server time (ms) | queries | query bound |",
        "|---|---|---:|---:|---:|",
    ]
    for who, page, ms, count, bound in results:
        lines.append(f"| {who} | `{page}` | {ms:.1f} | {count} | {bound} |")
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
