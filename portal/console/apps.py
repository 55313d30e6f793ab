from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "portal.console"
    label = "console"
    default_auto_field = "django.db.models.BigAutoField"
