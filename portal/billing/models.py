"""The usage ledger: append-only intervals, priced when they close."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from portal.accounts.models import Project
from portal.billing.pricing import MICROS_PER_UNIT, cost_micros
from portal.catalog.models import Tier

__all__ = ["MICROS_PER_UNIT", "UsageRecord", "cost_micros"]


class UsageRecord(models.Model):
    sandbox = models.ForeignKey("sandboxes.Sandbox", on_delete=models.PROTECT, related_name="usage")
    allocation_key = models.CharField(max_length=40)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="usage")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="usage")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="usage")
    gpu_model = models.CharField(max_length=40)
    milli_gpu = models.PositiveIntegerField(help_text="GPUs held, in thousandths.")
    # Price snapshot: later price changes do not reprice past usage.
    price_per_gpu_hour_micros = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    duration = models.DurationField(null=True, blank=True)
    cost_micros = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["allocation_key"],
                condition=models.Q(ended_at__isnull=True),
                name="%(app_label)s_%(class)s_one_open_per_allocation",
                violation_error_message="An allocation has at most one open usage interval.",
            ),
            models.CheckConstraint(
                condition=models.Q(ended_at__isnull=True) | models.Q(ended_at__gte=models.F("started_at")),
                name="%(app_label)s_%(class)s_ends_after_start",
                violation_error_message="A usage interval cannot end before it starts.",
            ),
        ]
        indexes = [
            # GET /api/v1/usage/ pages by project and time.
            models.Index(fields=["project", "-started_at"], name="usage_project_time_idx"),
        ]

    def __str__(self) -> str:
        return f"usage of sandbox {self.sandbox_id} from {self.started_at:%Y-%m-%d %H:%M}"

    @property
    def duration_display(self) -> str:
        """Readable length: "3.4 s", "12 min 5 s", "2 h 03 min"."""
        if self.duration is None:
            return "running"
        seconds = self.duration.total_seconds()
        if seconds < 60:
            return f"{seconds:.1f} s"
        minutes, secs = divmod(int(seconds), 60)
        if minutes < 60:
            return f"{minutes} min {secs} s"
        hours, minutes = divmod(minutes, 60)
        return f"{hours} h {minutes:02d} min"

    @property
    def cost_display(self) -> str:
        if self.cost_micros is None:
            return "—"
        return f"{self.cost_micros / MICROS_PER_UNIT:.4f} {self.currency}"
