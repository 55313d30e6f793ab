from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "portal.telemetry"
    label = "telemetry"
    default_auto_field = "django.db.models.BigAutoField"
