"""Asking the control worker for a scheduling cycle now, rather than at its next tick.

Each request, stop or move that changes what a cycle would decide asks, after its commit.
Asks that come before a cycle reads its queue are served by that cycle, so only the first
of them is sent: a burst of a hundred requests (the API, a script, the twin) sent a hundred
``schedule_cycle`` messages, and the control worker ran a hundred cycles' worth of locking
and fingerprinting for one cycle's work. A cycle clears the mark before it reads the queue
(``cycle_begins``), so a request committed after that read is asked for again.
"""

from __future__ import annotations

import functools
import logging

import redis
from django.conf import settings
from django.db import transaction

from wire.messages import to_control

log = logging.getLogger(__name__)
ASKED = "gpushare:cycle:asked"
# A mark whose cycle message was lost (a broker restart) holds asks back this long at most;
# the tick's own cycle (every CYCLE_INTERVAL_S) serves them meanwhile.
ASKED_TTL_S = 10


@functools.cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def ask_for_cycle() -> None:
    """After the current transaction commits, ask for a cycle unless one is already asked for."""
    transaction.on_commit(_ask)


def _ask() -> None:
    try:
        if not _redis().set(ASKED, 1, nx=True, ex=ASKED_TTL_S):
            return  # the cycle already asked for will read this change
    except redis.RedisError as exc:  # ask anyway: a cycle too many costs less than one missed
        log.debug("cycle ask not coalesced: %s", exc)
    to_control.schedule_cycle()


def cycle_begins() -> None:
    """Called by a cycle before it reads its queue: changes after this ask again."""
    try:
        _redis().delete(ASKED)
    except redis.RedisError as exc:
        log.debug("cycle ask mark not cleared: %s", exc)
