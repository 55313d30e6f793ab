from django.contrib import admin

from portal.admin_base import ReadOnlyModelAdmin
from portal.audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyModelAdmin):
    """Readable here as in the console; never written or deleted by hand."""

    list_display = ("at", "actor_name", "action", "target_type", "target_repr", "message")
    list_filter = ("action", "target_type")
    search_fields = ("actor_name", "target_repr", "message")
