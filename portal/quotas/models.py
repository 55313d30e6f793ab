"""Quotas: per project, per department above projects, per GPU model (the scheduler deepens
these into guaranteed and borrowed shares)."""

from __future__ import annotations

from django.db import models

from portal.accounts.models import Project


class Department(models.Model):
    """An organisational unit above projects (an institute, a group), in a tree: its
    guarantee and ceiling bound what all the projects below it hold together, and its weight
    is its say against its siblings in the fair share (scheduler/departments.py). A project's
    quota names the department it belongs to."""

    name = models.CharField(max_length=60, unique=True)
    parent = models.ForeignKey(
        "self",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="children",
        help_text="The unit it is part of; empty for a top-level unit.",
    )
    guaranteed_gpus = models.DecimalField(
        max_digits=7,
        decimal_places=3,
        null=True,
        blank=True,
        help_text="GPUs its projects hold together as of right; beyond, they borrow what others leave "
        "idle, and may lose it. Empty: what its parts guarantee, summed.",
    )
    max_gpus = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Whole-GPU equivalents its projects may hold together, borrowed included; empty for "
        "no limit of its own.",
    )
    weight = models.FloatField(default=1.0, help_text="Fair-share weight against its sibling units.")

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(weight__gt=0),
                name="%(app_label)s_%(class)s_weight_positive",
                violation_error_message="A fair-share weight must be above zero.",
            ),
            models.CheckConstraint(
                condition=models.Q(guaranteed_gpus__isnull=True)
                | models.Q(max_gpus__isnull=True)
                | models.Q(guaranteed_gpus__gte=0, guaranteed_gpus__lte=models.F("max_gpus")),
                name="%(app_label)s_%(class)s_guarantee_within_limit",
                violation_error_message="The guarantee must be between 0 and the limit.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def ancestors(self) -> list[Department]:
        """Its parent, the parent's parent, ... (a loop, which the console refuses, is cut)."""
        found: list[Department] = []
        here = self.parent
        while here is not None and here not in found and here != self:
            found.append(here)
            here = here.parent
        return found

    @property
    def path_text(self) -> str:
        """ "Physics / Vision lab": the units from the top down to this one."""
        return " / ".join(d.name for d in [*reversed(self.ancestors()), self])


class QuotaPolicy(models.Model):
    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="quota")
    department = models.ForeignKey(
        Department,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="quotas",
        help_text="The department the project belongs to; its guarantee and limit bound the project too.",
    )
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

    # A project's (its quota's), or a department's: what all of its projects hold together.
    quota = models.ForeignKey(
        QuotaPolicy, on_delete=models.CASCADE, related_name="model_quotas", null=True, blank=True
    )
    department = models.ForeignKey(
        Department, on_delete=models.CASCADE, related_name="model_quotas", null=True, blank=True
    )
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
            ),
            models.UniqueConstraint(
                fields=["department", "name"],
                name="%(app_label)s_%(class)s_one_per_department_name",
                violation_error_message="The department has a limit of that name already.",
            ),
            models.CheckConstraint(
                condition=models.Q(quota__isnull=True, department__isnull=False)
                | models.Q(quota__isnull=False, department__isnull=True),
                name="%(app_label)s_%(class)s_project_or_department",
                violation_error_message="A limit is a project's or a department's: name one of the two.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} limit of {self.quota.project if self.quota else self.department}"

    @property
    def covered(self) -> list[str]:
        """The models it limits."""
        return [str(m) for m in self.gpu_models] or [self.name]
