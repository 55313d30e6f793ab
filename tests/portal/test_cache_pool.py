"""Django's cache objects live one request each under ASGI; their Redis connections must not
(portal/cache_pool.py)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.cache.backends.redis import RedisCache


def _cache(location: str) -> RedisCache:
    return RedisCache(location, {"OPTIONS": settings.CACHES["default"]["OPTIONS"]})


def _pool(cache: RedisCache, write: bool = True) -> Any:
    return cache._cache._get_connection_pool(write=write)  # type: ignore[attr-defined]  # Django's client


def test_each_new_cache_object_uses_the_processs_one_pool() -> None:
    first, second = _cache(settings.REDIS_URL), _cache(settings.REDIS_URL)
    first.set("cache-pool-probe", 1)
    assert second.get("cache-pool-probe") == 1
    pool = _pool(first)
    assert _pool(second) is pool
    assert _pool(second, write=False) is pool
    # Each command hands its connection back and the next object's takes it again: ten more
    # objects open no connection beyond the one this process may have opened first.
    made_before = len(pool._available_connections) + len(pool._in_use_connections)
    for _ in range(10):
        assert _cache(settings.REDIS_URL).get("cache-pool-probe") == 1
    assert len(pool._available_connections) + len(pool._in_use_connections) <= max(made_before, 1)


def test_another_server_gets_its_own_pool() -> None:
    other = (
        "redis://127.0.0.1:6379/13" if not settings.REDIS_URL.endswith("/13") else "redis://127.0.0.1:6379/11"
    )
    assert _pool(_cache(other)) is not _pool(_cache(settings.REDIS_URL))
