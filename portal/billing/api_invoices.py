"""Read-only invoices of the caller's projects, with their lines and credit notes."""

from __future__ import annotations

import re
from datetime import date
from typing import Any

from django.db.models import Prefetch, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, serializers, viewsets

from portal.accounts.permissions import api_projects
from portal.billing.api_common import ERRORS, ApiView, CheckedPageSize
from portal.billing.models import CreditNote, Invoice, InvoiceLine, InvoiceState


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


@extend_schema_view(
    list=extend_schema(
        summary="Invoices",
        description="One per project, month and currency, newest month first. Drafts change as usage "
        "closes; finalized ones are frozen (corrections are credit notes). Scope read:usage.",
        parameters=INVOICE_FILTERS,
        responses={200: InvoiceSerializer(many=True), **ERRORS},
    ),
    retrieve=extend_schema(
        summary="One invoice, with its lines and credit notes",
        responses={200: InvoiceDetailSerializer, **ERRORS},
    ),
)
class InvoiceViewSet(
    ApiView, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[Invoice]
):
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
