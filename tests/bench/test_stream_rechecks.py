"""The re-check of 2,000 open sandbox sockets (``make bench``; prints, asserts no time).

2,000 people, each signed in with a sandbox page open (its ``/ws/sandboxes/<id>/`` socket),
ten to a project and its sandbox. Timed in CPU seconds of this process (``process_time``)
and in wall seconds, through ``streams.still_allowed``, the function the per-process task
calls every ``STREAM_RECHECK_S``, once for all 2,000 sockets; beside it, what asking for
each socket on its own costs (its user now, then its consumer's ``authorize``: what each
socket's own timer asked every period before the batch).
"""

from __future__ import annotations

import os
import time
from importlib import import_module
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.accounts.models import Membership, Project
from portal.accounts.streams import current_user, still_allowed
from portal.telemetry.consumers import SandboxSamples
from tests.portal.helpers import request

pytestmark = [pytest.mark.bench, pytest.mark.django_db(transaction=True)]
SOCKETS = int(os.environ.get("RECHECK_BENCH_SOCKETS", "2000"))
PER_PROJECT = 10


def _open_pages(people: Any, catalog: Any) -> list[SandboxSamples]:
    store = import_module(settings.SESSION_ENGINE).SessionStore
    user_model = type(people["owner"])
    users = user_model.objects.bulk_create(
        user_model(username=f"reader-{i:05d}", is_active=True) for i in range(SOCKETS)
    )
    consumers = []
    for start in range(0, SOCKETS, PER_PROJECT):
        project = Project.objects.create(slug=f"lab-{start:05d}", name=f"Lab {start}")
        owners = users[start : start + PER_PROJECT]
        Membership.objects.bulk_create(Membership(user=u, project=project, role="member") for u in owners)
        sandbox = request(owners[0], project, catalog["timeslice"], catalog["image"])
        for user in owners:
            session = store()
            session[SESSION_KEY] = str(user.pk)
            session.create()
            consumer = SandboxSamples()
            consumer.scope = {
                "user": user,
                "session": session,
                "url_route": {"kwargs": {"sandbox_id": sandbox.pk}},
            }
            consumers.append(consumer)
    return consumers


def _timed(run: Any) -> tuple[float, float, int]:
    with CaptureQueriesContext(connection) as queries:
        cpu, wall = time.process_time(), time.perf_counter()
        run()
        return time.process_time() - cpu, time.perf_counter() - wall, len(queries)


def test_rechecking_2000_open_sockets(people: Any, catalog: Any) -> None:
    consumers = _open_pages(people, catalog)
    assert all(still_allowed(consumers))  # warm: every one allowed
    batch_cpu, batch_wall, batch_queries = _timed(lambda: still_allowed(consumers))
    one_cpu, one_wall, one_queries = _timed(lambda: [c.authorize(current_user(c.scope)) for c in consumers])
    n = len(consumers)
    print(f"\nre-check of {n} open sandbox sockets ({connection.vendor}):")
    print(f"  one pass for all: {batch_cpu:.3f} s CPU, {batch_wall:.3f} s wall, {batch_queries} queries")
    print(f"    = {n / batch_cpu:,.0f} checks per CPU second")
    print(f"  one socket at a time: {one_cpu:.3f} s CPU, {one_wall:.3f} s wall, {one_queries} queries")
    print(f"    = {n / one_cpu:,.0f} checks per CPU second")
    period = settings.STREAM_RECHECK_S
    print(f"  at STREAM_RECHECK_S={period}: {batch_cpu / period:.1%} of a core batched, ", end="")
    print(f"{one_cpu / period:.1%} one socket at a time")
