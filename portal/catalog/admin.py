from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from portal.catalog.models import PriorityClass, SandboxImage, Tier
from portal.catalog.sharing import TIER_DESCRIPTION_HELP, tier_mode_help


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

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        """The same reminder as the console's tier form: gpushare states each mode's terms."""
        kwargs["help_texts"] = {
            **kwargs.get("help_texts", {}),
            "description": TIER_DESCRIPTION_HELP,
            "sharing_mode": tier_mode_help(),
        }
        return super().get_form(request, obj, change, **kwargs)


admin.site.register(PriorityClass)
admin.site.register(SandboxImage)
