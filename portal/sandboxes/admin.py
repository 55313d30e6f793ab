from django.contrib import admin

from portal.sandboxes.models import Sandbox, SandboxEvent


class EventInline(admin.TabularInline):
    model = SandboxEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "from_state", "to_state", "actor", "message", "data")


@admin.register(Sandbox)
class SandboxAdmin(admin.ModelAdmin):
    """Read-only here: state changes go through portal.sandboxes.actions."""

    list_display = ("pk", "project", "owner", "tier", "state", "host", "requested_at")
    list_filter = ("state", "tier")
    inlines = [EventInline]

    def has_change_permission(self, request, obj=None):
        return False
