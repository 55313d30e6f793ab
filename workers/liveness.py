"""Agents' liveness, kept apart from the queue their heartbeats travel in.

A heartbeat is a Celery message to the control queue. When the control workers were away
(killed, restarting, behind a backlog), beats wait in that queue behind older ticks, and a
tick that judged hosts on the database alone would find every host silent and mark healthy
hosts lost. So each agent also writes the time of its latest beat to Redis, and a host is
lost only when both the database and this key say it went quiet. With Redis unreadable the
database alone decides, as before.
"""

from __future__ import annotations

from typing import Any

KEY = "gpushare:agent:alive:{host}"
TTL_S = 300  # far longer than any lost-host window; the value, not the key's life, is judged


def note_alive(client: Any, host: str, t_ms: int) -> None:
    """``client`` is a sync ``redis.Redis``; called by the agent with every heartbeat."""
    client.set(KEY.format(host=host), t_ms, ex=TTL_S)


def alive_since(client: Any, hosts: list[str], cutoff_ms: int) -> set[str]:
    """The hosts among ``hosts`` whose agent beat at or after ``cutoff_ms``."""
    if not hosts:
        return set()
    values = client.mget([KEY.format(host=h) for h in hosts])
    return {h for h, v in zip(hosts, values, strict=True) if v is not None and int(v) >= cutoff_ms}
