from django.contrib import admin

from portal.telemetry.models import Alert, AlertPolicy


@admin.register(AlertPolicy)
class AlertPolicyAdmin(admin.ModelAdmin):
    list_display = (
        "__str__",
        "enabled",
        "temp_high_c",
        "util_high_pct",
        "util_minutes",
        "mem_high_pct",
        "xid",
    )
    list_select_related = ("tier",)


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ("raised_at", "kind", "host", "gpu", "sandbox", "message", "cleared_at")
    list_filter = ("kind", ("cleared_at", admin.EmptyFieldListFilter))
    list_select_related = ("host", "gpu", "sandbox")
    readonly_fields = [f.name for f in Alert._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False  # alerts come from agents' rules only
