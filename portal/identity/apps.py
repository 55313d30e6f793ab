from django.apps import AppConfig


class IdentityConfig(AppConfig):
    name = "portal.identity"
    label = "identity"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        try:  # django-auth-ldap is an optional extra (make install-ldap)
            from portal.identity import ldap_backend
        except ImportError:
            return
        ldap_backend.connect_error_log()
