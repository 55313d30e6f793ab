"""Agents' liveness, kept apart from the queue their heartbeats travel in.

A heartbeat is a Celery message to the control queue. When the control workers were away
(killed, restarting, behind a backlog), beats wait in that queue behind older ticks, and a
tick that judged hosts on the database alone would find every host silent and mark healthy
hosts lost. So each agent also writes the time of its latest beat to Redis, and a host is
lost only when both the database and this key say it went quiet. With Redis unreadable the
database alone decides, as before.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from wire.spec import HandleJson

KEY = "gpushare:agent:alive:{host}"
TTL_S = 300  # far longer than any lost-host window; the value, not the key's life, is judged


class OwnedSandbox(TypedDict):
    """One sandbox in a host's report of what it runs (``Beat.owned``), read by the control
    worker's reconciliation (``portal/control/reconcile.py``)."""

    allocation_key: str
    sandbox_id: int
    state: str  # "running" | "exited" | "created" (made, or still being launched)
    tracked: bool  # this agent launched it and holds its spec (else: found by its labels)
    # From the driver's status, for a sandbox it listed (one still being launched has none):
    exit_code: NotRequired[int | None]
    reason: NotRequired[str | None]  # why it exited, when the driver knows
    started_at_ms: NotRequired[int | None]
    ended_at_ms: NotRequired[int]  # an exited one's end, by an engine that keeps it (Slurm)
    handle: NotRequired[HandleJson]
    util: NotRequired[tuple[float | None, float] | None]  # (mean util %, window s) for idle culling


class Beat(TypedDict):
    """One host's heartbeat, as agents send it to the control queue (``agent_heartbeats``,
    a list of them: one for a real host's agent, one per host for a process serving many)."""

    host: str
    t_ms: int
    backend: str
    driver: str
    owned: list[OwnedSandbox] | None  # the report of what the host runs, when one is ready
    owned_ms: int | None  # when that report's listing began
    alerts_version: str | None  # the alert thresholds the agent holds


def note_alive(client: Any, hosts: list[str], t_ms: int) -> None:
    """``client`` is a sync ``redis.Redis``; called by an agent with every round of beats,
    one round trip however many hosts it serves."""
    pipe = client.pipeline(transaction=False)
    for host in hosts:
        pipe.set(KEY.format(host=host), t_ms, ex=TTL_S)
    pipe.execute()


def alive_since(client: Any, hosts: list[str], cutoff_ms: int) -> set[str]:
    """The hosts among ``hosts`` whose agent beat at or after ``cutoff_ms``."""
    if not hosts:
        return set()
    values = client.mget([KEY.format(host=h) for h in hosts])
    return {h for h, v in zip(hosts, values, strict=True) if v is not None and int(v) >= cutoff_ms}
