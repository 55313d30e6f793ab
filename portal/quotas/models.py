"""Per-project quotas (the scheduler deepens these into guaranteed and borrowed shares)."""

from __future__ import annotations

from django.db import models

from portal.accounts.models import Project


class QuotaPolicy(models.Model):
    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="quota")
    max_live_sandboxes = models.PositiveIntegerField(default=10)
    max_gpus = models.PositiveIntegerField(default=8, help_text="Whole-GPU equivalents held at once.")

    class Meta:
        verbose_name_plural = "quota policies"

    def __str__(self) -> str:
        return f"quota of {self.project}"
