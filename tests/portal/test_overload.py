"""A busy database sheds requests with 503 and Retry-After, never a 500 (portal/overload.py).

PostgreSQL: every connection of the process's pool is held, so a request waits its
DB_POOL_TIMEOUT_S and gives up. SQLite: another connection holds the write lock, so a
request that writes waits its busy timeout and gives up.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from psycopg_pool import PoolTimeout

from portal.overload import RETRY_AFTER_S
from tests.portal.helpers import client_for, request_form

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the connection pool is PostgreSQL's"
)
sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's write lock")


def _assert_shed(response: Any) -> None:
    assert response.status_code == 503
    assert response["Retry-After"] == str(RETRY_AFTER_S)


@contextmanager
def _every_pool_connection_held() -> Iterator[None]:
    """Takes every connection the pool may lend; requests then wait a short timeout."""
    pool = connection.pool  # type: ignore[attr-defined]  # PostgreSQL's wrapper only
    connection.close()  # this thread's own connection goes back to the pool first
    pool.open()
    held = []
    saved_timeout, pool.timeout = pool.timeout, 0.2
    try:
        while True:
            try:
                held.append(pool.getconn(timeout=0.2))
            except PoolTimeout:
                break
        # Some may be out already (a consumer thread's of an earlier test): the pool is empty.
        assert pool.get_stats()["pool_available"] == 0
        yield
    finally:
        for conn in held:
            pool.putconn(conn)
        pool.timeout = saved_timeout


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_an_exhausted_pool_answers_pages_and_api_with_503(people: Any) -> None:
    # The first query (the audit middleware's request.user) is outside any view: Django's
    # handler500 answers it, as it would in production, so the test client must not re-raise.
    owner = Client(raise_request_exception=False)
    owner.force_login(people["owner"])
    with _every_pool_connection_held():
        _assert_shed(owner.get(reverse("sandbox-list")))
        api = owner.get("/api/v1/sandboxes/")
        _assert_shed(api)
        assert api.json() == {"detail": "The portal is busy; try again in a few seconds."}
    assert owner.get(reverse("sandbox-list")).status_code == 200  # served again once free


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_a_locked_sqlite_database_answers_a_write_with_503(people: Any, catalog: Any) -> None:
    owner = client_for(people["owner"])
    writer = sqlite3.connect(connection.settings_dict["NAME"], timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another process (the control worker) writing
        connection.ensure_connection()
        connection.connection.execute("PRAGMA busy_timeout = 200")  # not the 20 s it waits
        # Inside the view this time: the middleware answers (DEBUG on or off).
        _assert_shed(owner.post(reverse("sandbox-new"), request_form(people, catalog)))
        assert owner.get(reverse("sandbox-list")).status_code == 200  # WAL: reads go on
    finally:
        writer.rollback()
        writer.close()
        connection.close()  # the next connection has the configured busy timeout again
