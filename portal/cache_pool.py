"""One Redis connection pool per process for Django's cache (and so the sessions and rate limits
it holds), instead of one per request.

Django keeps its cache objects in a context-local store; under ASGI every request runs in a
new context, so each request built a new ``RedisCache``, a new pool and a new TCP connection
to Redis, used it for one or two commands and dropped it (django/django#18459, open). Under
load, connecting was 5 % of the web processes' time. The cache's ``pool_class`` option lets
every one of those short-lived cache objects share this process's pool for the same server and
options: redis-py's pools are thread-safe, and a forked child's first use opens its own
connections (the pool checks its pid).
"""

from __future__ import annotations

import threading
from typing import Any

import redis

_MADE: dict[tuple[str, str], redis.ConnectionPool] = {}
_MAKING = threading.Lock()


class SharedConnectionPool(redis.ConnectionPool):
    """``from_url`` answers the pool it made before for the same URL and options."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Any:
        key = (url, repr(sorted(kwargs.items(), key=lambda item: item[0])))
        with _MAKING:
            pool = _MADE.get(key)
            if pool is None:
                pool = _MADE[key] = super().from_url(url, **kwargs)
        return pool
