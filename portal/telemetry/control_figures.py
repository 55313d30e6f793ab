"""How the control plane keeps up, as the control worker measures it: how late heartbeats
are applied, and how long scheduling cycles take.

Each figure is a capped Redis list of ``"<at_ms> <value_ms>"`` entries, newest first:
``/metrics`` shows the newest (``gpushare_heartbeat_lag_seconds``,
``gpushare_scheduling_cycle_seconds``), and the twin (``manage.py twin``) reads them all
for its percentiles. Writing one is a pipelined LPUSH and LTRIM beside work that takes
milliseconds at least; a Redis that is down loses the figure, never the work.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

log = logging.getLogger(__name__)

HEARTBEAT_LAG = "gpushare:control:heartbeat_lag"  # per agent_heartbeats message: now - its oldest beat
CYCLE = "gpushare:control:cycle"  # per scheduling cycle that decided: its total time
KEPT = 4096  # entries per figure: over an hour of heartbeat messages from a 1,213-host fleet


def record(client: Any, figure: str, at_ms: int, value_ms: float) -> None:
    """Add one measurement (``client``: a sync ``redis.Redis``)."""
    try:
        pipe = client.pipeline(transaction=False)
        pipe.lpush(figure, f"{at_ms} {value_ms:.1f}")
        pipe.ltrim(figure, 0, KEPT - 1)
        pipe.execute()
    except redis.RedisError as exc:
        log.debug("control figure %s not recorded: %s", figure, exc)


def read(client: Any, figure: str, count: int = KEPT) -> list[tuple[int, float]]:
    """The newest ``count`` measurements, newest first, as (at_ms, value_ms)."""
    out = []
    for raw in client.lrange(figure, 0, count - 1):
        at, _, value = raw.decode().partition(" ")
        out.append((int(at), float(value)))
    return out
