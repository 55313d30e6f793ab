"""Per-project quotas (the scheduler deepens these into guaranteed and borrowed shares)."""

from __future__ import annotations

from django.db import models

from portal.accounts.models import Project


class QuotaPolicy(models.Model):
    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="quota")
    max_live_sandboxes = models.PositiveIntegerField(default=10)
    max_gpus = models.PositiveIntegerField(
        default=8, help_text="Limit: whole-GPU equivalents held at once, borrowed capacity included."
    )
    guaranteed_gpus = models.DecimalField(
        max_digits=7,
        decimal_places=3,
        default=0,
        help_text="Guaranteed GPUs; anything above is borrowed and may be reclaimed.",
    )
    weight = models.FloatField(default=1.0, help_text="Fair-share weight against other projects.")
    max_gpu_hours_month = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="GPU-hours the project may use per calendar month (UTC); empty for no limit. "
        "Reached, new requests are refused; running sandboxes go on.",
    )

    class Meta:
        verbose_name_plural = "quota policies"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(weight__gt=0),
                name="%(app_label)s_%(class)s_weight_positive",
                violation_error_message="A fair-share weight must be above zero.",
            ),
            models.CheckConstraint(
                condition=models.Q(guaranteed_gpus__gte=0, guaranteed_gpus__lte=models.F("max_gpus")),
                name="%(app_label)s_%(class)s_guarantee_within_limit",
                violation_error_message="The guarantee must be between 0 and the limit.",
            ),
        ]

    def __str__(self) -> str:
        return f"quota of {self.project}"


class ModelQuota(models.Model):
    """A project's cap on some GPU models, beside its quota's caps on all of them: one model
    ("H100-80GB") or a class of models an admin names ("Hopper": H100-80GB and H200). The
    scheduler holds what the project runs on them at once to ``max_gpus``
    (scheduler/model_quotas.py); once their GPU-hours of the month are used, nothing more
    starts on them. A request for any model is placed on a model still within its caps."""

    quota = models.ForeignKey(QuotaPolicy, on_delete=models.CASCADE, related_name="model_quotas")
    name = models.CharField(
        max_length=40, help_text="The GPU model (H100-80GB), or a name for a class of models (Hopper)."
    )
    gpu_models = models.JSONField(
        default=list, blank=True, help_text="The models a class covers; empty: the model named."
    )
    max_gpus = models.PositiveIntegerField(
        null=True, blank=True, help_text="Whole GPUs of these models held at once; empty for no limit."
    )
    max_gpu_hours_month = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="GPU-hours on these models per calendar month (UTC); empty for no limit.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["quota", "name"],
                name="%(app_label)s_%(class)s_one_per_name",
                violation_error_message="The project has a limit of that name already.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} limit of {self.quota.project}"

    @property
    def covered(self) -> list[str]:
        """The models it limits."""
        return [str(m) for m in self.gpu_models] or [self.name]
