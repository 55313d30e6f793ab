from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "portal.catalog"
    label = "catalog"
    default_auto_field = "django.db.models.BigAutoField"
