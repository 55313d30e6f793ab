"""Allocated, used, idle and unmeasured GPU-hours, per sandbox, project or tier, over a period.

- **allocated**: what the ledger billed: each usage interval's share (``milli_gpu / 1000``)
  times its length, clipped to the period (an open interval counts up to ``now``).
- **used**: allocated time weighted by the sandbox's GPU utilization, minute by minute,
  from its one-minute ``SandboxRollup`` (``util_mean_pct``, held within 0..100).
- **unmeasured**: allocated time in minutes with no rollup (an agent down, a minute not yet
  reported), or with a rollup whose utilization is null (a MIG device NVML cannot measure
  without GPM: an A100). It is neither used nor idle: we do not know, so it is reported apart rather
  than guessed, and a bill can show it as such.
- **idle**: the rest, ``allocated - used - unmeasured``: measured minutes the GPU share
  was held but not busy.

So ``allocated == used + idle + unmeasured`` exactly: the figures are ``Decimal`` GPU-hours
computed from PostgreSQL ``numeric`` sums (no float rounding). A rollup minute that an
interval covers only in part counts for the part it covers.

One SQL query per call, whatever the number of rows: the intervals overlapping the period
are clipped in the database, joined to their rollups through the (sandbox, minute) unique
index, and summed per group, on PostgreSQL (``EXTRACT(EPOCH FROM interval)``, ``numeric``).
The embedded SQLite deployment gets the same figures computed in Python from the same rows
(two queries); tests check that both agree on PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

from django.db import connection
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.telemetry.models import SandboxRollup

Grouping = Literal["sandbox", "project", "tier"]
_COLUMNS: dict[str, str] = {"sandbox": "sandbox_id", "project": "project_id", "tier": "tier_id"}
_MILLI_SECONDS_PER_GPU_HOUR = Decimal(1000 * 3600)
# Each sum is rounded to a nano-GPU-hour first, so the differences (idle, unmeasured) are
# exact and the four figures add up without a rounding residue.
_QUANTUM = Decimal("0.000000001")
_MINUTE = timedelta(minutes=1)


@dataclass(frozen=True)
class GpuHours:
    """One group's GPU-hours over the period; ``allocated == used + idle + unmeasured``."""

    allocated: Decimal
    used: Decimal
    idle: Decimal
    unmeasured: Decimal

    @property
    def utilization(self) -> Decimal | None:
        """Used over measured time (None when nothing was measured)."""
        measured = self.allocated - self.unmeasured
        return self.used / measured if measured else None


# {col} is one of _COLUMNS' values, never user input. Both sums are in milli-GPU-seconds.
_SQL = """
WITH iv AS (
    SELECT u.{col} AS k, u.sandbox_id, u.milli_gpu,
           GREATEST(u.started_at, %(start)s) AS a,
           LEAST(COALESCE(u.ended_at, %(now)s), %(end)s) AS b
    FROM billing_usagerecord u
    WHERE u.started_at < %(end)s AND (u.ended_at IS NULL OR u.ended_at > %(start)s)
      AND (%(only)s::bigint[] IS NULL OR u.{col} = ANY(%(only)s::bigint[]))
      AND (%(projects)s::bigint[] IS NULL OR u.project_id = ANY(%(projects)s::bigint[]))
      AND (%(tiers)s::bigint[] IS NULL OR u.tier_id = ANY(%(tiers)s::bigint[]))
), alloc AS (
    SELECT k, SUM(milli_gpu * EXTRACT(EPOCH FROM b - a)) AS allocated
    FROM iv WHERE b > a GROUP BY k
), meas AS (
    SELECT iv.k,
           SUM(iv.milli_gpu * EXTRACT(EPOCH FROM part)) AS measured,
           SUM(iv.milli_gpu * EXTRACT(EPOCH FROM part)
               * LEAST(GREATEST(r.util_mean_pct, 0), 100)::numeric / 100) AS used
    FROM iv
    JOIN telemetry_sandboxrollup r
      ON r.sandbox_id = iv.sandbox_id AND r.minute < iv.b AND r.minute + interval '1 minute' > iv.a
     AND r.util_mean_pct IS NOT NULL
    CROSS JOIN LATERAL (
        SELECT LEAST(iv.b, r.minute + interval '1 minute') - GREATEST(iv.a, r.minute) AS part
    ) p
    WHERE iv.b > iv.a
    GROUP BY iv.k
)
SELECT alloc.k, alloc.allocated, COALESCE(meas.measured, 0), COALESCE(meas.used, 0)
FROM alloc LEFT JOIN meas ON meas.k = alloc.k
"""


def gpu_hours(
    by: Grouping,
    start: datetime,
    end: datetime,
    *,
    now: datetime | None = None,
    only: list[int] | None = None,
    projects: list[int] | None = None,
    tiers: list[int] | None = None,
) -> dict[int, GpuHours]:
    """GPU-hours in ``[start, end)`` per sandbox, project or tier id (``by``); ``only`` keeps
    those ids, ``projects`` and ``tiers`` only usage of those projects and tiers. Groups with
    no allocated time in the period are absent."""
    now = now or timezone.now()
    if connection.vendor != "postgresql":
        return _gpu_hours_in_python(by, start, end, now=now, only=only, projects=projects, tiers=tiers)
    params = {"start": start, "end": end, "now": now, "only": only, "projects": projects, "tiers": tiers}
    with connection.cursor() as cursor:
        cursor.execute(_SQL.format(col=_COLUMNS[by]), params)
        rows = cursor.fetchall()
    return {key: _figures(allocated, measured, used) for key, allocated, measured, used in rows}


def _figures(allocated_ms: Any, measured_ms: Any, used_ms: Any) -> GpuHours:
    """Milli-GPU-seconds sums to GPU-hours, each rounded to the same quantum first."""
    allocated, measured, used = (
        (Decimal(v) / _MILLI_SECONDS_PER_GPU_HOUR).quantize(_QUANTUM)
        for v in (allocated_ms, measured_ms, used_ms)
    )
    return GpuHours(allocated, used, measured - used, allocated - measured)


def _seconds(delta: timedelta) -> Decimal:
    # Exact: a timedelta is whole days, seconds and microseconds.
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 1_000_000


def _gpu_hours_in_python(
    by: Grouping,
    start: datetime,
    end: datetime,
    *,
    now: datetime,
    only: list[int] | None,
    projects: list[int] | None,
    tiers: list[int] | None,
) -> dict[int, GpuHours]:
    """The SQL above, row by row: for SQLite, where a deployment is small."""
    records = UsageRecord.objects.filter(started_at__lt=end).exclude(ended_at__lte=start)
    if only is not None:
        records = records.filter(**{f"{_COLUMNS[by]}__in": only})
    if projects is not None:
        records = records.filter(project_id__in=projects)
    if tiers is not None:
        records = records.filter(tier_id__in=tiers)
    intervals = []
    for key, sandbox_id, milli, started, ended in records.values_list(
        _COLUMNS[by], "sandbox_id", "milli_gpu", "started_at", "ended_at"
    ):
        a, b = max(started, start), min(ended or now, end)
        if b > a:
            intervals.append((key, sandbox_id, milli, a, b))
    if not intervals:
        return {}
    rollups: dict[int, list[tuple[datetime, float | None]]] = {}
    for sandbox_id, minute, util in (
        SandboxRollup.objects.filter(
            sandbox_id__in={i[1] for i in intervals},
            minute__gt=min(i[3] for i in intervals) - _MINUTE,
            minute__lt=max(i[4] for i in intervals),
        )
        .order_by("minute")
        .values_list("sandbox_id", "minute", "util_mean_pct")
    ):
        rollups.setdefault(sandbox_id, []).append((minute, util))
    sums: dict[int, list[Decimal]] = {}
    for key, sandbox_id, milli, a, b in intervals:
        total = sums.setdefault(key, [Decimal(0), Decimal(0), Decimal(0)])
        total[0] += milli * _seconds(b - a)
        for minute, util in rollups.get(sandbox_id, []):
            part = min(b, minute + _MINUTE) - max(a, minute)
            if part > timedelta(0) and util is not None:  # null: unmeasured, not idle
                held = milli * _seconds(part)
                total[1] += held
                total[2] += held * Decimal(f"{min(max(util, 0.0), 100.0):.15g}") / 100
    return {key: _figures(*total) for key, total in sums.items()}


def by_sandbox(
    start: datetime, end: datetime, *, now: datetime | None = None, only: list[int] | None = None
) -> dict[int, GpuHours]:
    return gpu_hours("sandbox", start, end, now=now, only=only)
