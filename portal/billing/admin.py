from django.contrib import admin

from portal.billing.models import UsageRecord


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
