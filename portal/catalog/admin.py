from django.contrib import admin

from portal.catalog.models import PriorityClass, SandboxImage, Tier


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "sharing_mode",
        "isolation_levels",
        "price_display",
        "priority_class",
        "max_duration",
        "over_share",
        "active",
    )


admin.site.register(PriorityClass)
admin.site.register(SandboxImage)
