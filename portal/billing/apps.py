from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "portal.billing"
    label = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Webhooks for usage.closed and sandbox.stopped hang on post_save, so the ledger and
        # the sandbox actions need not know about them.
        from portal.billing import webhooks

        webhooks.connect()
