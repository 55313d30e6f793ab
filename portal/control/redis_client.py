"""The control worker's Redis client (locks, the liveness of agents and of itself)."""

from __future__ import annotations

import redis
from django.conf import settings


def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)
