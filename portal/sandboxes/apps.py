from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "portal.sandboxes"
    label = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"
