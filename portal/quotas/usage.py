"""How much of its GPU-hour budget a project has used."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import F, FloatField, Func, Sum

from portal.billing.models import UsageRecord


class DurationSeconds(Func):
    """A DurationField's length in seconds, on either database: PostgreSQL keeps an
    interval, SQLite a count of microseconds (where Django refuses ``int * duration``)."""

    arity = 1
    output_field = FloatField()

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)", **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="(%(expressions)s / 1000000.0)", **extra)


def month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def gpu_hours_since(project_id: int, since: datetime, now: datetime) -> float:
    """GPU-hours (whole-GPU equivalents x hours) of the project's usage since ``since``,
    open intervals counted up to ``now``. Two queries, whatever the number of intervals."""
    held = Sum(F("milli_gpu") * DurationSeconds("duration"), output_field=FloatField())
    records = UsageRecord.objects.filter(project_id=project_id, started_at__gte=since)
    milli_seconds = records.filter(ended_at__isnull=False).aggregate(total=held)["total"] or 0
    hours = float(milli_seconds) / 3600 / 1000
    for milli, started_at in records.filter(ended_at__isnull=True).values_list("milli_gpu", "started_at"):
        hours += milli / 1000 * max(0.0, (now - started_at).total_seconds()) / 3600
    return hours
