"""What telemetry keeps: one-minute rollups of every GPU and sandbox, alert thresholds
and the alerts they raised.

Live samples are never stored: agents stream them to the channel layer and fold them into
one-minute (min, mean, max) rollups that the control worker upserts, so a minute reported
twice is stored once. Rollups older than ``TELEMETRY_RETENTION_DAYS`` are deleted.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import F, Q


class GpuRollup(models.Model):
    """One GPU's figures over one minute (``minute`` is the minute's start, UTC)."""

    gpu = models.ForeignKey("fleet.Gpu", on_delete=models.CASCADE, related_name="rollups")
    minute = models.DateTimeField()
    samples = models.PositiveSmallIntegerField()
    temp_min_c = models.FloatField()
    temp_mean_c = models.FloatField()
    temp_max_c = models.FloatField()
    # null: no sample of the minute measured utilization (a MIG device without GPM); never 0
    util_min_pct = models.FloatField(null=True, blank=True)
    util_mean_pct = models.FloatField(null=True, blank=True)
    util_max_pct = models.FloatField(null=True, blank=True)
    mem_min_mib = models.IntegerField()
    mem_mean_mib = models.IntegerField()
    mem_max_mib = models.IntegerField()
    mem_total_mib = models.IntegerField()
    power_min_w = models.FloatField()
    power_mean_w = models.FloatField()
    power_max_w = models.FloatField()
    sm_clock_mean_mhz = models.IntegerField()
    throttled_samples = models.PositiveSmallIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu", "minute"], name="gpurollup_one_per_minute")]
        indexes = [models.Index(fields=["minute"], name="gpurollup_minute_idx")]

    def __str__(self) -> str:
        return f"{self.gpu_id} {self.minute:%Y-%m-%d %H:%M}"


class SandboxRollup(models.Model):
    """One sandbox's figures over one minute: the GPU memory it held and the utilization,
    temperature and power of its device. No cost: the usage ledger has it for any moment
    (portal.billing.ledger.cost_by), and the chart's history reads it from there."""

    sandbox = models.ForeignKey("sandboxes.Sandbox", on_delete=models.CASCADE, related_name="rollups")
    minute = models.DateTimeField()
    samples = models.PositiveSmallIntegerField()
    mem_min_mib = models.IntegerField()
    mem_mean_mib = models.IntegerField()
    mem_max_mib = models.IntegerField()
    util_min_pct = models.FloatField(null=True, blank=True)  # null: unmeasured, as above
    util_mean_pct = models.FloatField(null=True, blank=True)
    util_max_pct = models.FloatField(null=True, blank=True)
    temp_max_c = models.FloatField()
    power_mean_w = models.FloatField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["sandbox", "minute"], name="sandboxrollup_one_per_minute")
        ]
        indexes = [models.Index(fields=["minute"], name="sandboxrollup_minute_idx")]

    def __str__(self) -> str:
        return f"sandbox {self.sandbox_id} {self.minute:%Y-%m-%d %H:%M}"


class AlertPolicy(models.Model):
    """Alert thresholds: the fleet's (no tier; applies to every GPU, and to sandboxes whose
    tier has none) or one tier's (applies to that tier's sandboxes).

    Every rule has hysteresis: it raises once the value has stayed over the high mark for
    its hold time and clears only once it has stayed under the clear mark as long, so a
    value hovering at the threshold does not flap.
    """

    tier = models.OneToOneField(
        "catalog.Tier", on_delete=models.CASCADE, null=True, blank=True, related_name="alert_policy"
    )
    enabled = models.BooleanField(default=True)
    temp_high_c = models.PositiveSmallIntegerField(default=85, help_text="Raise over this temperature.")
    temp_clear_c = models.PositiveSmallIntegerField(default=80, help_text="Clear under this temperature.")
    util_high_pct = models.PositiveSmallIntegerField(default=95, help_text="Raise over this utilization…")
    util_clear_pct = models.PositiveSmallIntegerField(default=90, help_text="Clear under this utilization.")
    util_minutes = models.PositiveSmallIntegerField(default=15, help_text="…held this many minutes.")
    mem_high_pct = models.PositiveSmallIntegerField(default=95, help_text="Raise over this % of memory.")
    mem_clear_pct = models.PositiveSmallIntegerField(default=90, help_text="Clear under this % of memory.")
    throttle_s = models.PositiveSmallIntegerField(
        default=30, help_text="Raise when clocks are held down (thermal, power brake, HW slowdown) this long."
    )
    xid = models.BooleanField(
        default=True, help_text="Raise on an XID error (clears after 10 quiet minutes)."
    )
    hold_s = models.PositiveSmallIntegerField(
        default=10, help_text="Seconds a temperature or memory value must hold before it raises or clears."
    )

    class Meta:
        verbose_name_plural = "alert policies"
        constraints = [
            models.UniqueConstraint(fields=["tier"], condition=Q(tier__isnull=True), name="one_fleet_policy"),
            models.CheckConstraint(condition=Q(temp_clear_c__lt=F("temp_high_c")), name="temp_hysteresis"),
            models.CheckConstraint(
                condition=Q(util_clear_pct__lt=F("util_high_pct")), name="util_hysteresis"
            ),
            models.CheckConstraint(condition=Q(mem_clear_pct__lt=F("mem_high_pct")), name="mem_hysteresis"),
            models.CheckConstraint(
                condition=Q(util_high_pct__lte=100, mem_high_pct__lte=100), name="alert_pct_max_100"
            ),
        ]

    def __str__(self) -> str:
        return f"alerts for {self.tier}" if self.tier_id else "fleet alerts"

    def clean(self) -> None:
        errors = {}
        if self.temp_clear_c >= self.temp_high_c:
            errors["temp_clear_c"] = "Must be below the raise temperature, or the alert would flap."
        if self.util_clear_pct >= self.util_high_pct:
            errors["util_clear_pct"] = "Must be below the raise utilization, or the alert would flap."
        if self.mem_clear_pct >= self.mem_high_pct:
            errors["mem_clear_pct"] = "Must be below the raise memory share, or the alert would flap."
        for field in ("util_high_pct", "mem_high_pct"):
            if getattr(self, field) > 100:
                errors[field] = "A percentage is at most 100."
        if errors:
            raise ValidationError(errors)

    def rules(self) -> dict[str, Any]:
        """The thresholds as the agent evaluates them (workers/host/alerts.py)."""
        return {
            "enabled": self.enabled,
            "temp_high_c": self.temp_high_c,
            "temp_clear_c": self.temp_clear_c,
            "util_high_pct": self.util_high_pct,
            "util_clear_pct": self.util_clear_pct,
            "util_s": self.util_minutes * 60,
            "mem_high_pct": self.mem_high_pct,
            "mem_clear_pct": self.mem_clear_pct,
            "throttle_s": self.throttle_s,
            "xid": self.xid,
            "hold_s": self.hold_s,
        }


class Alert(models.Model):
    """An alert raised by an agent's rules, open until its condition clears.

    ``key`` is made by the agent when it raises the alert, so a report delivered twice
    opens one alert and its clearing closes that one.
    """

    class Kind(models.TextChoices):
        TEMPERATURE = "temperature", "Temperature"
        THROTTLE = "throttle", "Throttling"
        XID = "xid", "XID error"
        ECC = "ecc", "Double-bit ECC error"
        GPU_LOST = "gpu_lost", "GPU lost"
        UTILIZATION = "utilization", "Utilization held high"
        MEMORY = "memory", "Memory nearly full"
        # Raised by the control worker, not an agent: a message signed by one host that spoke
        # for another, or one whose signature did not verify (portal/control/provenance.py).
        FORGED = "forged", "Forged message"
        # Raised by the control worker: a Slurm job's accounting (slurmdbd) and gpushare's
        # ledger disagree on its time or its GRES (portal/control/slurm_accounting.py).
        ACCOUNTING = "accounting", "Accounting mismatch"

    key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    host = models.ForeignKey("fleet.Host", on_delete=models.CASCADE, related_name="alerts")
    gpu = models.ForeignKey(
        "fleet.Gpu", on_delete=models.CASCADE, null=True, blank=True, related_name="alerts"
    )
    sandbox = models.ForeignKey(
        "sandboxes.Sandbox", on_delete=models.CASCADE, null=True, blank=True, related_name="alerts"
    )
    message = models.CharField(max_length=300)
    value = models.FloatField()
    threshold = models.FloatField()
    raised_at = models.DateTimeField()
    cleared_at = models.DateTimeField(null=True, blank=True)
    clear_reason = models.CharField(max_length=120, blank=True)

    class Meta:
        ordering = ["-raised_at"]
        indexes = [models.Index(fields=["cleared_at", "raised_at"], name="alert_open_idx")]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"
