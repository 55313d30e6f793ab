from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.admin_base import ReadOnlyModelAdmin
from portal.billing import invoices, webhooks
from portal.billing.models import (
    CreditNote,
    Invoice,
    InvoiceLine,
    InvoiceState,
    UsageRecord,
    WebhookDelivery,
    WebhookEndpoint,
)


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """The ledger is append-only: readable here, never edited."""

    list_display = (
        "sandbox",
        "project",
        "tier",
        "milli_gpu",
        "started_at",
        "ended_at",
        "cost_micros",
        "currency",
    )

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class _ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class InvoiceLineInline(_ReadOnlyInline):
    model = InvoiceLine
    fields = (
        "sandbox_id",
        "tier",
        "gpu_model",
        "milli_gpu",
        "started_at",
        "ended_at",
        "seconds",
        "cost_micros",
    )
    readonly_fields = fields


class CreditNoteInline(_ReadOnlyInline):
    model = CreditNote
    fields = ("number", "amount_micros", "reason", "created_at", "created_by")
    readonly_fields = fields


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    """Invoices change only through portal.billing.invoices: drafts are rebuilt from the
    ledger, finalized ones are frozen (corrections are credit notes)."""

    list_display = ("__str__", "project", "period_start", "currency", "state", "total_micros", "finalized_at")
    list_filter = ("state", "period_start", "currency")
    search_fields = ("number", "project__slug", "project__name")
    readonly_fields = (
        "project",
        "period_start",
        "currency",
        "state",
        "number",
        "total_micros",
        "created_at",
        "updated_at",
        "finalized_at",
    )
    inlines = (InvoiceLineInline, CreditNoteInline)
    actions = ("finalize",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A finalized invoice opens read-only (saving it would be refused anyway).
        ok = super().has_change_permission(request, obj)
        return ok and (obj is None or obj.state == InvoiceState.DRAFT)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Finalize selected draft invoices")
    def finalize(self, request: HttpRequest, queryset: QuerySet[Invoice]) -> None:
        done = 0
        for invoice in queryset.filter(state=InvoiceState.DRAFT):
            invoices.do_finalize(invoice, request.user)
            done += 1
        self.message_user(request, f"{done} invoice(s) finalized.", messages.SUCCESS)


@admin.register(CreditNote)
class CreditNoteAdmin(ReadOnlyModelAdmin):
    """Insert-only; issued through portal.billing.invoices.do_credit (bounded by the
    invoice's total), not through this form."""

    list_display = ("number", "invoice", "amount_micros", "reason", "created_at", "created_by")
    search_fields = ("number", "invoice__number")


RECENT_DELIVERIES = 20


class RecentDeliveryInline(_ReadOnlyInline):
    model = WebhookDelivery
    fields = ("event", "event_id", "attempts", "last_status", "last_error", "delivered_at", "next_attempt_at")
    readonly_fields = fields
    show_change_link = True
    verbose_name_plural = f"recent deliveries (last {RECENT_DELIVERIES})"

    def get_queryset(self, request: HttpRequest) -> QuerySet[WebhookDelivery]:
        # The admin filters the inline's queryset by endpoint, so it cannot be sliced here:
        # keep the newest per endpoint by id instead.
        qs = super().get_queryset(request)
        endpoint_id = request.resolver_match.kwargs.get("object_id") if request.resolver_match else None
        if endpoint_id is None:
            return qs.none()
        recent = qs.filter(endpoint_id=endpoint_id).order_by("-pk").values_list("pk", flat=True)
        return qs.filter(pk__in=list(recent[:RECENT_DELIVERIES]))


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    list_display = ("url", "project", "events", "active", "created_at")
    list_filter = ("active",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
    inlines = (RecentDeliveryInline,)


class DeliveryStatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("delivered", "Delivered"), ("pending", "Pending"), ("failed", "Failed")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]
    ) -> QuerySet[WebhookDelivery]:
        value = self.value()
        if value == "delivered":
            return queryset.filter(delivered_at__isnull=False)
        if value == "pending":
            return queryset.filter(delivered_at__isnull=True, next_attempt_at__isnull=False)
        if value == "failed":
            return queryset.filter(delivered_at__isnull=True, next_attempt_at__isnull=True)
        return queryset


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = (
        "event",
        "event_id",
        "endpoint",
        "status",
        "attempts",
        "last_status",
        "delivered_at",
        "created_at",
    )
    list_filter = ("event", DeliveryStatusFilter, "endpoint")
    search_fields = ("event_id",)
    list_select_related = ("endpoint",)
    readonly_fields = (
        "endpoint",
        "event",
        "event_id",
        "payload",
        "attempts",
        "last_status",
        "last_error",
        "attempt_log",
        "next_attempt_at",
        "delivered_at",
        "created_at",
    )
    actions = ("redeliver",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Redeliver selected (same event id)")
    def redeliver(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        count = 0
        for delivery in queryset:
            try:
                webhooks.do_redeliver(delivery)
            except ValidationError as exc:  # pragma: no cover - defensive
                self.message_user(request, f"{delivery}: {exc}", messages.ERROR)
                continue
            count += 1
        self.message_user(request, f"{count} deliveries queued again.", messages.SUCCESS)
