"""GET /api/v1/utilization/: allocated, used, idle and unmeasured GPU-hours over a period,
per project, tier or sandbox (portal/telemetry/utilization.py computes them)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers, views
from rest_framework.request import Request
from rest_framework.response import Response

from portal.accounts.models import Project
from portal.accounts.permissions import api_projects, api_sees_all
from portal.api.errors import ERRORS
from portal.api.filters import FILTER_PARAMETERS, moment
from portal.api.views import ApiView
from portal.catalog.models import Tier
from portal.quotas.usage import month_start
from portal.sandboxes.models import Sandbox
from portal.telemetry.utilization import GpuHours, Grouping, gpu_hours

# The query reads every interval and rollup minute of the period: a year is plenty for a
# report and keeps one request's cost bounded.
MAX_PERIOD = timedelta(days=366)
GROUPINGS: tuple[Grouping, ...] = ("project", "tier", "sandbox")


class UtilizationRowSerializer(serializers.Serializer[GpuHours]):
    key = serializers.CharField(help_text="Project or tier slug, or the sandbox id.")
    allocated_gpu_hours = serializers.DecimalField(max_digits=24, decimal_places=9, source="allocated")
    used_gpu_hours = serializers.DecimalField(
        max_digits=24, decimal_places=9, source="used", help_text="Allocated time x GPU utilization."
    )
    idle_gpu_hours = serializers.DecimalField(
        max_digits=24, decimal_places=9, source="idle", help_text="Measured, held, not busy."
    )
    unmeasured_gpu_hours = serializers.DecimalField(
        max_digits=24,
        decimal_places=9,
        source="unmeasured",
        help_text="Allocated minutes with no telemetry (agent down, minute not reported yet).",
    )
    utilization = serializers.FloatField(
        allow_null=True, help_text="Used over measured time, 0..1; null when nothing was measured."
    )


class UtilizationSerializer(serializers.Serializer[Any]):
    by = serializers.ChoiceField(choices=GROUPINGS)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    results = UtilizationRowSerializer(many=True)


class UtilizationView(ApiView, views.APIView):
    filters = ("by", "project", "tier", "start", "end")

    @extend_schema(
        summary="Allocated, used, idle and unmeasured GPU-hours",
        description=(
            "Per project, tier or sandbox over `[start, end)` (default: this month so far, UTC). "
            "`allocated = used + idle + unmeasured` exactly. Allocated is what the ledger bills "
            "(share x time; an open interval counts up to now); used weights it minute by minute "
            "by the sandbox's GPU utilization. Only your projects' usage, unless an admin. "
            "Periods up to 366 days. Scope read:usage."
        ),
        parameters=[
            OpenApiParameter(
                "by", OpenApiTypes.STR, enum=GROUPINGS, description="Grouping (default project)."
            ),
            # project, tier, start and end as for usage (period defaults: this month so far).
            *(p for p in FILTER_PARAMETERS if p.name != "user"),
        ],
        responses={200: UtilizationSerializer, **ERRORS},
        examples=[
            OpenApiExample(
                "per project",
                response_only=True,
                value={
                    "by": "project",
                    "start": "2026-11-01T00:00:00Z",
                    "end": "2026-11-21T12:00:00Z",
                    "results": [
                        {
                            "key": "vision",
                            "allocated_gpu_hours": "11.500000000",
                            "used_gpu_hours": "2.100000000",
                            "idle_gpu_hours": "2.400000000",
                            "unmeasured_gpu_hours": "7.000000000",
                            "utilization": 0.4666666666666667,
                        }
                    ],
                },
            )
        ],
    )
    def get(self, request: Request) -> Response:
        params = request.query_params  # checked by ApiView.initial: known names, plain text
        by = cast(Grouping, params.get("by", "project"))
        if by not in GROUPINGS:
            raise exceptions.ValidationError({"by": [f"Give one of {', '.join(GROUPINGS)}."]})
        now = timezone.now()
        start, end = self._period(params, now)
        projects = None if api_sees_all(request) else list(api_projects(request).values_list("pk", flat=True))
        if slug := params.get("project"):
            wanted = Project.objects.filter(slug=slug).values_list("pk", flat=True)
            projects = [pk for pk in wanted if projects is None or pk in projects]
        tiers = (
            list(Tier.objects.filter(slug=slug).values_list("pk", flat=True))
            if (slug := params.get("tier"))
            else None
        )
        figures = gpu_hours(by, start, end, now=now, projects=projects, tiers=tiers)
        keys = self._keys(by, list(figures))
        rows = sorted(
            ({"key": keys[pk], **_as_dict(h)} for pk, h in figures.items()),
            key=lambda row: (-row["allocated"], row["key"]),
        )
        body = {"by": by, "start": start, "end": end, "results": rows}
        return Response(UtilizationSerializer(body).data)

    @staticmethod
    def _period(params: Any, now: datetime) -> tuple[datetime, datetime]:
        start = moment("start", params["start"]) if params.get("start") else month_start(now)
        end = moment("end", params["end"]) if params.get("end") else now
        if end <= start:
            raise exceptions.ValidationError({"end": ["The end must come after the start."]})
        if end - start > MAX_PERIOD:
            raise exceptions.ValidationError({"end": ["The period is at most 366 days; ask for less."]})
        return start, end

    @staticmethod
    def _keys(by: Grouping, pks: list[int]) -> dict[int, str]:
        if by == "sandbox":
            return {pk: str(pk) for pk in Sandbox.objects.filter(pk__in=pks).values_list("pk", flat=True)}
        model = Project if by == "project" else Tier
        return dict(model.objects.filter(pk__in=pks).values_list("pk", "slug"))


def _as_dict(h: GpuHours) -> dict[str, Any]:
    return {
        "allocated": h.allocated,
        "used": h.used,
        "idle": h.idle,
        "unmeasured": h.unmeasured,
        "utilization": float(h.utilization) if h.utilization is not None else None,
    }
