from django.apps import AppConfig


class AuditConfig(AppConfig):
    """The audit trail: who changed what, before and after. The lowest app: every other app
    may record into it; it imports none of them (the console's ready() chooses which models
    are watched)."""

    name = "portal.audit"
    label = "audit"
    default_auto_field = "django.db.models.BigAutoField"
