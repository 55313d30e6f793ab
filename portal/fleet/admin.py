from django.contrib import admin

from portal.fleet.models import Gpu, Host, MigInstance


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "backend", "driver", "last_heartbeat_at")


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ("host", "index", "model", "uuid", "sharing_mode", "mig_enabled", "state")
    list_filter = ("host", "sharing_mode", "state")


admin.site.register(MigInstance)
