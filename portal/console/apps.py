from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "portal.console"
    label = "console"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model

        from portal.accounts.models import Membership, Project
        from portal.audit.trail import watch
        from portal.catalog.models import ImageRegistry, PriorityClass, SandboxImage, Storage, Tier
        from portal.fleet.models import Gpu
        from portal.identity.models import GroupRule
        from portal.quotas.models import Department, ModelQuota, QuotaPolicy

        watch(
            Tier,
            PriorityClass,
            SandboxImage,
            Storage,
            ImageRegistry,
            GroupRule,
            QuotaPolicy,
            ModelQuota,
            Department,
            Project,
            Membership,
            Gpu,
            get_user_model(),
        )
