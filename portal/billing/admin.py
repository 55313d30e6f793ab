from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.admin_base import ReadOnlyModelAdmin
from portal.billing import invoices
from portal.billing.models import (
    CreditNote,
    Invoice,
    InvoiceLine,
    InvoiceState,
    UsageRecord,
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
