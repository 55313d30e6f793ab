"""How much of its GPU-hour budget a project has used."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import DurationField, ExpressionWrapper, F, Sum

from portal.billing.models import UsageRecord


def month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def gpu_hours_since(project_id: int, since: datetime, now: datetime) -> float:
    """GPU-hours (whole-GPU equivalents x hours) of the project's usage since ``since``,
    open intervals counted up to ``now``. Two queries, whatever the number of intervals."""
    held = ExpressionWrapper(F("milli_gpu") * F("duration"), output_field=DurationField())
    records = UsageRecord.objects.filter(project_id=project_id, started_at__gte=since)
    closed = records.filter(ended_at__isnull=False).aggregate(total=Sum(held))["total"] or timedelta(0)
    hours = closed.total_seconds() / 3600 / 1000
    for milli, started_at in records.filter(ended_at__isnull=True).values_list("milli_gpu", "started_at"):
        hours += milli / 1000 * max(0.0, (now - started_at).total_seconds()) / 3600
    return hours
