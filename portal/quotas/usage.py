"""How much of its GPU-hour budget a project has used."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import F, FloatField, Func, Sum

from portal.billing.models import UsageRecord
from portal.quotas.departments import project_ids_below
from portal.quotas.models import ModelQuota


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


def gpu_hours_since(
    project_id: int | list[int], since: datetime, now: datetime, gpu_models: list[str] | None = None
) -> float:
    """GPU-hours (whole-GPU equivalents x hours) of the project's (or projects') usage since
    ``since``, open intervals counted up to ``now``; only on ``gpu_models`` if given. Two
    queries, whatever the number of intervals."""
    held = Sum(F("milli_gpu") * DurationSeconds("duration"), output_field=FloatField())
    ids = project_id if isinstance(project_id, list) else [project_id]
    records = UsageRecord.objects.filter(project_id__in=ids, started_at__gte=since)
    if gpu_models is not None:
        records = records.filter(gpu_model__in=gpu_models)
    milli_seconds = records.filter(ended_at__isnull=False).aggregate(total=held)["total"] or 0
    hours = float(milli_seconds) / 3600 / 1000
    for milli, started_at in records.filter(ended_at__isnull=True).values_list("milli_gpu", "started_at"):
        hours += milli / 1000 * max(0.0, (now - started_at).total_seconds()) / 3600
    return hours


def model_hours_used_up(row: ModelQuota, now: datetime, label: str = "") -> str:
    """How a limit per GPU model (``row``) ran out of its GPU-hours this month, or "" while
    some are left (or it sets none): "project vision has used 10.2 of its 10 H100-80GB
    GPU-hours this month". A department's counts every project under it. ``label``: how to
    name the project or department (its slug or name, by default)."""
    if row.max_gpu_hours_month is None:
        return ""
    if row.quota is not None:
        whose: int | list[int] = row.quota.project_id
        label = label or f"project {row.quota.project.slug}"
    else:
        assert row.department is not None  # noqa: S101 - a check constraint: one or the other
        whose = project_ids_below(row.department)
        label = label or f"department {row.department.name}"
    used = gpu_hours_since(whose, month_start(now), now, row.covered)
    if used < row.max_gpu_hours_month:
        return ""
    return f"{label} has used {used:.1f} of its {row.max_gpu_hours_month} {row.name} GPU-hours this month"
