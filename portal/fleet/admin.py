from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.fleet.health import do_drain_gpu, do_undrain_gpu
from portal.fleet.models import FleetEvent, Gpu, Host, MigInstance


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "backend", "driver", "last_heartbeat_at")


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ("host", "index", "model", "uuid", "sharing_mode", "mig_enabled", "state", "drain_reason")
    list_filter = ("host", "sharing_mode", "state")
    readonly_fields = ("state", "drain_reason")  # changed through the drain actions only
    actions = ["drain", "undrain"]

    @admin.action(description="Drain the selected GPUs (no new sandboxes)")
    def drain(self, request: HttpRequest, queryset: QuerySet[Gpu]) -> None:
        done = sum(
            do_drain_gpu(g.uuid, f"drained by {request.user} in admin", request.user) for g in queryset
        )
        self.message_user(request, f"{done} GPU(s) drained.", messages.SUCCESS)

    @admin.action(description="Undrain the selected GPUs")
    def undrain(self, request: HttpRequest, queryset: QuerySet[Gpu]) -> None:
        done = sum(do_undrain_gpu(g.uuid, request.user) for g in queryset)
        self.message_user(request, f"{done} GPU(s) back in service.", messages.SUCCESS)


@admin.register(FleetEvent)
class FleetEventAdmin(admin.ModelAdmin):
    list_display = ("at", "host", "gpu", "kind", "severity", "message", "actor", "acknowledged_at")
    list_filter = ("severity", "kind", "host")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a record of what happened


admin.site.register(MigInstance)
