"""The fleet's models in Django admin. GPUs are registered by ``portal.console.admin``: their
drain actions go through the control layer (``portal.control.faults``: the owners of the
sandboxes on a drained GPU are told), which this app may not import."""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from portal.fleet.models import FleetEvent, Host, MigInstance


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "backend", "driver", "last_heartbeat_at")
    readonly_fields = ("state",)  # changed by portal.fleet.actions only (lost, back up)


@admin.register(FleetEvent)
class FleetEventAdmin(admin.ModelAdmin):
    list_display = ("at", "host", "gpu", "kind", "severity", "message", "actor", "acknowledged_at")
    list_filter = ("severity", "kind", "host")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a record of what happened


admin.site.register(MigInstance)
