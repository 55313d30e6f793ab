"""The list filters most routes share: ``?project=&user=&tier=&start=&end=``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter
from rest_framework import exceptions

FILTERS = ("project", "user", "tier", "start", "end")
FILTER_PARAMETERS = [
    OpenApiParameter("project", OpenApiTypes.STR, description="Project slug."),
    OpenApiParameter("user", OpenApiTypes.STR, description="Username."),
    OpenApiParameter("tier", OpenApiTypes.STR, description="Tier slug."),
    OpenApiParameter(
        "start",
        OpenApiTypes.DATETIME,
        description="Period start (ISO 8601, inclusive; a date means its midnight UTC).",
        examples=[OpenApiExample("month", value="2026-11-01T00:00:00Z")],
    ),
    OpenApiParameter("end", OpenApiTypes.DATETIME, description="Period end (ISO 8601, exclusive)."),
]


def moment(name: str, raw: str) -> datetime:
    """An aware UTC datetime, or a 400 naming the parameter."""
    try:
        value = parse_datetime(raw)
        if value is None and (day := parse_date(raw)) is not None:
            value = datetime(day.year, day.month, day.day, tzinfo=UTC)
        if value is not None:
            # In UTC: PostgreSQL refuses offsets it does not know (e.g. -17:14).
            value = value.replace(tzinfo=UTC) if timezone.is_naive(value) else value.astimezone(UTC)
    except (ValueError, OverflowError):
        value = None
    if value is None:
        raise exceptions.ValidationError({name: [f"Not an ISO 8601 date or time: {raw[:40]!r}."]})
    return value


def filter_by(
    params: Any, qs: QuerySet[Any], *, user_field: str, time_field: str, tier: bool = True
) -> QuerySet[Any]:
    """Apply ?project=&user=&tier=&start=&end=; an unknown slug simply matches nothing."""
    for name in ("project", "user", "tier", "start", "end"):
        if "\x00" in params.get(name, ""):  # PostgreSQL refuses NUL in text
            raise exceptions.ValidationError({name: ["Null characters are not allowed."]})
    if project := params.get("project"):
        qs = qs.filter(project__slug=project)
    if user := params.get("user"):
        qs = qs.filter(**{f"{user_field}__username": user})
    if tier and (slug := params.get("tier")):
        qs = qs.filter(tier__slug=slug)
    start = moment("start", params["start"]) if params.get("start") else None
    end = moment("end", params["end"]) if params.get("end") else None
    if start and end and end <= start:
        raise exceptions.ValidationError({"end": ["The end must come after the start."]})
    if start:
        qs = qs.filter(**{f"{time_field}__gte": start})
    if end:
        qs = qs.filter(**{f"{time_field}__lt": end})
    return qs
