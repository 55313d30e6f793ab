from django.apps import AppConfig
from django.db.models.signals import post_save


class SandboxesConfig(AppConfig):
    name = "portal.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal.sandboxes import live
        from portal.sandboxes.models import SandboxEvent

        post_save.connect(live.timeline_grew, sender=SandboxEvent, dispatch_uid="sandbox-timeline-grew")
