from django.apps import AppConfig


class TwinConfig(AppConfig):
    name = "portal.twin"
    label = "twin"
    verbose_name = "Trace twin"
