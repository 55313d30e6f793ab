"""Every page at scale (200 GPUs, 1,000 sandboxes) answers with a bounded number of
queries, asserted here; the server times are measured by ``make bench``
(tests/bench/test_page_times.py) into BENCHMARKS.md, never asserted."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.portal.helpers import client_for, request_form
from tests.portal.scale import seed_scale

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs"), pytest.mark.slow]

# (who, method, path, the most queries it may take). {sandbox} is a running sandbox of the
# owner's. The bounds hold whatever the number of sandboxes: lists are paged or capped.
PAGES: list[tuple[str, str, str, int]] = [
    ("owner", "GET", "/sandboxes/", 5),
    # 1 for the most replicas a GPU is cut into (sharing terms), 1 for the fleet's GPU models (the menu)
    ("owner", "GET", "/sandboxes/new/", 10),
    # 2 for the tier's storage (checked, then shown), 1 for the departments (fair share's tree)
    ("owner", "POST", "/sandboxes/preview/", 27),
    ("owner", "GET", "/sandboxes/{sandbox}/", 9),
    ("owner", "GET", "/sandboxes/{sandbox}/status/", 9),
    ("owner", "GET", "/notifications/", 5),
    ("owner", "GET", "/projects/", 9),
    ("owner", "GET", "/projects/vision/", 15),
    ("owner", "GET", "/api/v1/sandboxes/", 4),
    ("owner", "GET", "/api/v1/usage/", 4),
    ("admin", "GET", "/sandboxes/", 5),
    ("admin", "GET", "/console/fleet/", 10),
    ("admin", "GET", "/console/queue/", 15),
    ("admin", "GET", "/console/plans/", 6),
    ("admin", "GET", "/api/v1/sandboxes/", 4),
]


def measure(people: Any, catalog: Any) -> list[tuple[str, str, float, int, int]]:
    """(who, path, server ms, queries, bound) per page, after one warm-up request each."""
    world = seed_scale(people, catalog)
    clients = {"owner": client_for(people["owner"]), "admin": client_for(people["admin"])}
    form = request_form(people, catalog)
    results = []
    for who, method, template, bound in PAGES:
        path = template.format(sandbox=world["sandbox"].pk)
        client = clients[who]

        def call(client: Any = client, method: str = method, path: str = path) -> Any:
            return client.post(path, form) if method == "POST" else client.get(path)

        assert call().status_code == 200, path  # warm-up: templates, caches
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            response = call()
            elapsed_ms = (time.perf_counter() - started) * 1000
        assert response.status_code == 200, path
        results.append((who, f"{method} {template}", elapsed_ms, len(queries), bound))
    return results


def test_every_page_takes_a_bounded_number_of_queries_at_scale(
    people: Any, catalog: Any, sent_tasks: Any
) -> None:
    results = measure(people, catalog)
    for who, page, ms, count, bound in results:
        print(f"{who:6} {page:36} {ms:7.1f} ms {count:3} queries (at most {bound})")
    over = [
        f"{page} as {who}: {count} queries, bound {bound}"
        for who, page, _, count, bound in results
        if count > bound
    ]
    assert not over, "\n".join(over)
