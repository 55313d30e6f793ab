from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from portal.console.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """Readable here as in the console; never written or deleted by hand."""

    list_display = ("at", "actor_name", "action", "target_type", "target_repr", "message")
    list_filter = ("action", "target_type")
    search_fields = ("actor_name", "target_repr", "message")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
