"""The money API (/api/v1/): usage intervals and their CSV export, invoices with their
lines and credit notes, and prices (open tiers). Objects outside the caller's projects are
404, exactly as in the HTML views."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from datetime import date
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.db.models.functions import Coalesce
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, renderers, serializers, views, viewsets
from rest_framework.request import Request

from portal.accounts.permissions import api_projects, api_sees_all
from portal.api.errors import ERRORS, errors
from portal.api.filters import FILTER_PARAMETERS, FILTERS, filter_by
from portal.api.pagination import BySlug, CheckedPageSize, NewestFirst
from portal.api.schema import list_and_retrieve_schema
from portal.api.views import ApiView
from portal.billing.models import CreditNote, Invoice, InvoiceLine, InvoiceState, UsageRecord
from portal.catalog.models import Tier
from portal.catalog.sharing import modes_text


class UsageRecordSerializer(serializers.ModelSerializer[UsageRecord]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    user: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    tier: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    duration_seconds = serializers.SerializerMethodField()
    billed_milli = serializers.IntegerField(
        source="priced_milli",
        read_only=True,
        help_text="What the price is charged on, in thousandths: the GPUs held (milli_gpu), or 1000 "
        "for a CPU-only sandbox (milli_gpu 0), whose tier's price is per hour of the sandbox.",
    )

    class Meta:
        model = UsageRecord
        fields = [
            "id",
            "sandbox",
            "allocation_key",
            "project",
            "user",
            "tier",
            "gpu_model",
            "milli_gpu",
            "billed_milli",
            "price_per_gpu_hour_micros",
            "currency",
            "started_at",
            "ended_at",
            "duration_seconds",
            "cost_micros",
        ]
        read_only_fields = fields

    def get_duration_seconds(self, obj: UsageRecord) -> float | None:
        return obj.duration.total_seconds() if obj.duration is not None else None


def usage_for(request: Request) -> QuerySet[UsageRecord]:
    """The caller's usage with the request's filters (period: started_at in [start, end))."""
    qs = UsageRecord.objects.all()
    if not api_sees_all(request):
        qs = qs.filter(project__in=api_projects(request))
    return filter_by(request.query_params, qs, user_field="user", time_field="started_at")


@list_and_retrieve_schema(
    listed="Usage intervals",
    description="Newest first, cursor pages. Scope read:usage. Costs are micro-units of `currency`; "
    "an open interval has no end and no cost yet.",
    one="One usage interval",
    serializer=UsageRecordSerializer,
)
class UsageRecordViewSet(ApiView, viewsets.ReadOnlyModelViewSet[UsageRecord]):
    """Usage intervals of the caller's projects, newest first; closed ones carry their cost."""

    serializer_class = UsageRecordSerializer
    pagination_class = NewestFirst
    filters = FILTERS
    queryset = UsageRecord.objects.none()  # for the schema; get_queryset scopes it

    def get_queryset(self) -> QuerySet[UsageRecord]:
        if self.action == "list":
            qs = usage_for(self.request)
        else:
            qs = UsageRecord.objects.filter(project__in=api_projects(self.request))
        return qs.select_related("project", "user", "tier")


CSV_COLUMNS = [
    "id", "sandbox_id", "project", "user", "tier", "gpu_model", "milli_gpu",
    "price_per_gpu_hour_micros", "cost_micros", "currency", "started_at", "ended_at", "duration_seconds",
    "billed_milli",
]  # fmt: skip


class CsvRenderer(renderers.BaseRenderer):
    """Lets ``Accept: text/csv`` through content negotiation; the view streams the body."""

    media_type = "text/csv"
    format = "csv"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> Any:
        # Only errors get here (the export streams its own body): "field,message" rows.
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["field", "message"])
        for field, problem in (data or {}).items():
            writer.writerow([field, "; ".join(map(str, problem)) if isinstance(problem, list) else problem])
        return out.getvalue().encode()


class _Echo:
    def write(self, value: str) -> str:
        return value


def _csv_rows(qs: QuerySet[UsageRecord]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    rows = qs.values_list(
        "id", "sandbox_id", "project__slug", "user__username", "tier__slug", "gpu_model", "milli_gpu",
        "price_per_gpu_hour_micros", "cost_micros", "currency", "started_at", "ended_at", "duration",
        Coalesce("billed_milli", "milli_gpu"),
    ).order_by("-started_at", "-id")  # fmt: skip
    for *head, started, ended, duration, billed in rows.iterator(chunk_size=2000):
        yield writer.writerow(
            [
                *["" if v is None else v for v in head],
                started.isoformat(),
                ended.isoformat() if ended else "",
                f"{duration.total_seconds():.3f}" if duration is not None else "",
                billed,
            ]
        )


class UsageExportView(ApiView, views.APIView):
    renderer_classes = [renderers.JSONRenderer, CsvRenderer]
    filters = FILTERS

    @extend_schema(
        summary="Usage as CSV",
        description="The same filters as the usage list, all matching rows, newest first, streamed. "
        "Money in micro-units (1/1,000,000) of the `currency` column. Scope read:usage.",
        parameters=FILTER_PARAMETERS,
        responses={
            (200, "text/csv"): OpenApiResponse(
                OpenApiTypes.STR,
                examples=[
                    OpenApiExample(
                        "csv",
                        value=",".join(CSV_COLUMNS)
                        + "\r\n7,12,vision,mark,dedicated,H100-80GB,1000,2500000,2500000,EUR,"
                        "2026-11-01T10:00:00+00:00,2026-11-01T11:00:00+00:00,3600.000,1000\r\n",
                    )
                ],
            ),
            **errors(400, 401, 403, 429),
        },
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        qs = usage_for(request)
        response = StreamingHttpResponse(_csv_rows(qs), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="usage.csv"'
        return response


# --- invoices ---


class InvoiceLineSerializer(serializers.ModelSerializer[InvoiceLine]):
    tier: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = InvoiceLine
        fields = [
            "id", "usage_record", "sandbox_id", "tier", "gpu_model", "milli_gpu",
            "price_per_gpu_hour_micros", "started_at", "ended_at", "seconds", "cost_micros",
        ]  # fmt: skip
        read_only_fields = fields


class CreditNoteSerializer(serializers.ModelSerializer[CreditNote]):
    class Meta:
        model = CreditNote
        fields = ["number", "reason", "amount_micros", "created_at"]
        read_only_fields = fields


class InvoiceSerializer(serializers.ModelSerializer[Invoice]):
    project: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = Invoice
        fields = [
            "id", "number", "project", "period_start", "currency", "state", "total_micros",
            "created_at", "finalized_at",
        ]  # fmt: skip
        read_only_fields = fields


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)
    credit_notes = CreditNoteSerializer(many=True, read_only=True)

    class Meta(InvoiceSerializer.Meta):
        fields = [*InvoiceSerializer.Meta.fields, "lines", "credit_notes"]
        read_only_fields = fields


class NewestPeriodFirst(CheckedPageSize):
    ordering = ("-period_start", "-id")


INVOICE_FILTERS = [
    OpenApiParameter("project", OpenApiTypes.STR, description="Project slug."),
    OpenApiParameter("period", OpenApiTypes.STR, description="Billed month, YYYY-MM (UTC)."),
    OpenApiParameter("state", OpenApiTypes.STR, enum=InvoiceState.values, description="draft or finalized."),
]


def _period(raw: str) -> date:
    if not re.fullmatch(r"\d{4}-\d{2}", raw) or not 1 <= int(raw[5:]) <= 12 or int(raw[:4]) < 1:
        raise exceptions.ValidationError({"period": ["Give the month as YYYY-MM, e.g. 2026-11."]})
    return date(int(raw[:4]), int(raw[5:]), 1)


@list_and_retrieve_schema(
    listed="Invoices",
    description="One per project, month and currency, newest month first. Drafts change as usage "
    "closes; finalized ones are frozen (corrections are credit notes). Scope read:usage.",
    one="One invoice, with its lines and credit notes",
    serializer=InvoiceSerializer,
    detail=InvoiceDetailSerializer,
    parameters=INVOICE_FILTERS,
)
class InvoiceViewSet(ApiView, viewsets.ReadOnlyModelViewSet[Invoice]):
    pagination_class = NewestPeriodFirst
    filters = ("project", "period", "state")
    queryset = Invoice.objects.none()  # for the schema; get_queryset scopes it

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Invoice]]:
        return InvoiceDetailSerializer if self.action == "retrieve" else InvoiceSerializer

    def get_queryset(self) -> QuerySet[Invoice]:
        qs = Invoice.objects.filter(project__in=api_projects(self.request)).select_related("project")
        if self.action == "retrieve":
            return qs.prefetch_related(
                Prefetch("lines", InvoiceLine.objects.select_related("tier")), "credit_notes"
            )
        params = self.request.query_params
        for name in ("project", "period", "state"):
            if "\x00" in params.get(name, ""):  # PostgreSQL refuses NUL in text
                raise exceptions.ValidationError({name: ["Null characters are not allowed."]})
        if project := params.get("project"):
            qs = qs.filter(project__slug=project)
        if period := params.get("period"):
            qs = qs.filter(period_start=_period(period))
        if state := params.get("state"):
            if state not in InvoiceState.values:
                raise exceptions.ValidationError({"state": ["Give draft or finalized."]})
            qs = qs.filter(state=state)
        return qs


# --- prices ---


class PriceSerializer(serializers.ModelSerializer[Tier]):
    mode = serializers.CharField(source="sharing_mode", help_text=f"The tier's sharing mode. {modes_text()}")
    max_duration_hours = serializers.SerializerMethodField()

    class Meta:
        model = Tier
        fields = [
            "slug",
            "name",
            "description",
            "mode",
            "isolation_levels",
            "price_per_gpu_hour_micros",
            "currency",
            "max_gpus",
            "gpu_models",
            "max_duration_hours",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "gpu_models": {
                "help_text": "The GPU models a request may pick (gpu_model); empty: any model of the fleet."
            }
        }

    def get_max_duration_hours(self, obj: Tier) -> float:
        return obj.max_duration.total_seconds() / 3600


@extend_schema_view(
    list=extend_schema(
        summary="Prices",
        description="Open tiers with their price per GPU-hour in micro-units of `currency`; a "
        "CPU-only tier (`mode` cpu) holds no GPU and charges that price per hour of each sandbox. "
        "Scope read:usage.",
        responses={200: PriceSerializer(many=True), **ERRORS},
    )
)
class PriceViewSet(ApiView, mixins.ListModelMixin, viewsets.GenericViewSet[Tier]):
    serializer_class = PriceSerializer
    pagination_class = BySlug
    queryset = Tier.objects.filter(active=True)
