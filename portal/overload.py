"""Load beyond what the database can serve is shed with 503 and ``Retry-After``, never a 500.

Three answers mean "busy", not "broken": the connection pool lent no connection within
DB_POOL_TIMEOUT_S (psycopg_pool's PoolTimeout), PostgreSQL refused a connection because its
slots are taken (SQLSTATE 53300 too_many_connections, 57P03 cannot_connect_now), and SQLite
gave up waiting for the write lock ("database is locked" after its busy timeout). A client (a
browser's htmx, the command-line client, a script) can come back later; a 500 would say the
request itself was at fault and page an operator.

The middleware catches them when a view raises; ``server_error`` (Django's handler500) catches
them anywhere else in the request (a middleware's session save), since Django calls it while
the exception is being handled.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
from collections.abc import Callable

import psycopg
from django.db import OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import server_error as django_server_error

log = logging.getLogger(__name__)

# Long enough for a burst to drain, short enough that a waiting page comes back soon.
RETRY_AFTER_S = 5
_BUSY_SQLSTATES = frozenset({"53300", "57P03"})


def is_overload(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what Django wrapped in it) says the database is busy."""
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__
    if isinstance(cause, psycopg.OperationalError):
        # psycopg_pool's PoolTimeout is a psycopg OperationalError without a SQLSTATE.
        return type(cause).__name__ == "PoolTimeout" or cause.sqlstate in _BUSY_SQLSTATES
    if isinstance(cause, sqlite3.OperationalError):
        return "database is locked" in str(cause)
    return False


def busy_response(request: HttpRequest) -> HttpResponse:
    """503 with Retry-After: JSON for the API (its error shape), a short page otherwise."""
    message = "The portal is busy; try again in a few seconds."
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": message}, status=503)
    else:
        response = HttpResponse(message, content_type="text/plain; charset=utf-8", status=503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


class OverloadMiddleware:
    """Turns a busy database under a view into 503 + Retry-After (DEBUG on or off)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not is_overload(exception):
            return None
        log.warning("database busy, shed %s %s: %s", request.method, request.path, exception)
        return busy_response(request)


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's handler500, except for a busy database raised outside a view."""
    if is_overload(sys.exc_info()[1]):
        return busy_response(request)
    return django_server_error(request)
