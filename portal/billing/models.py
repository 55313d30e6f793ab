"""The usage ledger: append-only intervals, priced when they close."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.accounts.models import Project
from portal.billing.pricing import MICROS_PER_UNIT, cost_micros, format_money
from portal.catalog.models import Tier
from portal.durations import duration_text

__all__ = [
    "MICROS_PER_UNIT",
    "CreditNote",
    "Invoice",
    "InvoiceLine",
    "InvoiceState",
    "UsageRecord",
    "cost_micros",
]


class UsageRecord(models.Model):
    sandbox = models.ForeignKey("sandboxes.Sandbox", on_delete=models.PROTECT, related_name="usage")
    allocation_key = models.CharField(max_length=40)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="usage")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="usage")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="usage")
    gpu_model = models.CharField(max_length=40)
    milli_gpu = models.PositiveIntegerField(help_text="GPUs held, in thousandths.")
    # What the price is charged on, in thousandths (``priced_milli``): the GPUs held on a GPU
    # tier; the sandbox itself (1000) on a CPU-only tier, which holds no GPU and whose price
    # is per hour of the sandbox. GPU-hours (quotas, fair share) read milli_gpu; money this.
    # Null in rows from before CPU-only tiers: those priced their GPUs, milli_gpu.
    billed_milli = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Units the price is charged on, in thousandths: GPUs held, or 1000 for a CPU-only "
        "sandbox (empty: milli_gpu).",
    )
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
            # GET /api/v1/usage/ pages newest first by (started_at, id): with the id in the
            # index the cursor's ORDER BY and WHERE are one index range, no sort, for a
            # project's pages and for staff or period-only pages alike.
            models.Index(fields=["project", "-started_at", "-id"], name="usage_project_page_idx"),
            models.Index(fields=["-started_at", "-id"], name="usage_page_idx"),
        ]

    def __str__(self) -> str:
        return f"usage of sandbox {self.sandbox_id} from {self.started_at:%Y-%m-%d %H:%M}"

    @property
    def priced_milli(self) -> int:
        """What the price is charged on, in thousandths (see ``billed_milli``)."""
        return self.milli_gpu if self.billed_milli is None else self.billed_milli

    @property
    def duration_display(self) -> str:
        """Readable length: "3.4 s", "12 min 5 s", "2 h 3 min"."""
        return "running" if self.duration is None else duration_text(self.duration)

    @property
    def cost_display(self) -> str:
        if self.cost_micros is None:
            return "—"
        return f"{self.cost_micros / MICROS_PER_UNIT:.4f} {self.currency}"


class InvoiceState(models.TextChoices):
    """``draft`` (rebuilt from the ledger as usage closes) -> ``finalized`` (numbered,
    frozen: the database refuses any change; corrections are credit notes)."""

    DRAFT = "draft", "Draft"
    FINALIZED = "finalized", "Finalized"


class Invoice(models.Model):
    """One project's usage in one calendar month (UTC) and one currency.

    Built by ``portal.billing.invoices``; once finalized, neither the model nor the
    database (triggers in migration 0002) lets the row or its lines change.
    """

    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="invoices")
    period_start = models.DateField(help_text="First day of the billed month (UTC).")
    currency = models.CharField(max_length=3)
    state = models.CharField(max_length=16, choices=InvoiceState.choices, default=InvoiceState.DRAFT)
    number = models.CharField(max_length=32, unique=True, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finalized_at = models.DateTimeField(null=True, blank=True)
    total_micros = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-period_start", "project_id", "currency"]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "period_start", "currency"],
                name="%(app_label)s_%(class)s_one_per_project_month_currency",
                violation_error_message="A project has one invoice per month and currency.",
            ),
            models.CheckConstraint(
                condition=models.Q(period_start__day=1),
                name="%(app_label)s_%(class)s_period_is_month",
                violation_error_message="An invoice's period starts on the first day of a month.",
            ),
            models.CheckConstraint(
                condition=(
                    models.Q(state="draft", number__isnull=True, finalized_at__isnull=True)
                    | models.Q(state="finalized", number__isnull=False, finalized_at__isnull=False)
                ),
                name="%(app_label)s_%(class)s_number_iff_finalized",
                violation_error_message="A finalized invoice has a number and a time; a draft has neither.",
            ),
        ]
        indexes = [
            # The tick finalizes old drafts: WHERE state='draft' AND period_start < ...
            models.Index(
                fields=["period_start"], name="invoice_draft_period_idx", condition=models.Q(state="draft")
            ),
        ]

    def __str__(self) -> str:
        return self.number or f"draft {self.project_id} {self.period_start:%Y-%m} {self.currency}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # The stored row decides, not this instance: finalizing a draft is the last change.
        if self._stored_state() == InvoiceState.FINALIZED:
            raise PermissionError(f"invoice {self.number} is finalized: correct it with a credit note")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        if self._stored_state() == InvoiceState.FINALIZED:
            raise PermissionError(f"invoice {self.number} is finalized and cannot be deleted")
        return super().delete(*args, **kwargs)

    def _stored_state(self) -> str | None:
        if self.pk is None:
            return None
        return Invoice.objects.filter(pk=self.pk).values_list("state", flat=True).first()

    @property
    def credited_micros(self) -> int:
        return int(self.credit_notes.aggregate(s=models.Sum("amount_micros"))["s"] or 0)

    @property
    def total_display(self) -> str:
        return format_money(self.total_micros, self.currency)


class InvoiceLine(models.Model):
    """The part of one usage interval that falls inside the invoice's month.

    An interval spanning months is cut at the month boundaries (UTC). Each part's cost is
    ``C(end of part - start of record) - C(start of part - start of record)`` with ``C``
    the ledger's own ``cost_micros`` on whole microseconds: the parts telescope, so they
    sum exactly to ``C(duration)``, the record's cost, whatever the rounding (the first
    part is priced alone, each later part gets the remainder).
    """

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    usage_record = models.ForeignKey(UsageRecord, on_delete=models.PROTECT, related_name="invoice_lines")
    sandbox_id = models.BigIntegerField()  # denormalised: the invoice reads alone
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="+")
    gpu_model = models.CharField(max_length=40)
    milli_gpu = models.PositiveIntegerField()
    price_per_gpu_hour_micros = models.BigIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    seconds = models.DecimalField(max_digits=18, decimal_places=6)  # exact to the microsecond
    cost_micros = models.BigIntegerField()

    class Meta:
        ordering = ["started_at", "pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["invoice", "usage_record"],
                name="%(app_label)s_%(class)s_one_per_record",
                violation_error_message="A usage record appears once on an invoice.",
            ),
            models.CheckConstraint(
                condition=models.Q(ended_at__gte=models.F("started_at")),
                name="%(app_label)s_%(class)s_ends_after_start",
                violation_error_message="An invoice line cannot end before it starts.",
            ),
        ]

    def __str__(self) -> str:
        return f"sandbox {self.sandbox_id} {self.started_at:%Y-%m-%d %H:%M} ({self.seconds} s)"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self._frozen():
            raise PermissionError("the lines of a finalized invoice cannot change")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        if self._frozen():
            raise PermissionError("the lines of a finalized invoice cannot change")
        return super().delete(*args, **kwargs)

    def _frozen(self) -> bool:
        return Invoice.objects.filter(pk=self.invoice_id, state=InvoiceState.FINALIZED).exists()


class CreditNote(models.Model):
    """A correction to a finalized invoice: insert-only (the database refuses UPDATE and
    DELETE), and together never more than the invoice's total."""

    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="credit_notes")
    number = models.CharField(max_length=32, unique=True)
    reason = models.CharField(max_length=300)
    amount_micros = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    # PROTECT, not SET_NULL: nulling the column would be an UPDATE the trigger refuses.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(amount_micros__gt=0),
                name="%(app_label)s_%(class)s_amount_positive",
                violation_error_message="A credit note credits a positive amount.",
            ),
        ]

    def __str__(self) -> str:
        return self.number

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise PermissionError("credit notes are insert-only: issue another one")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise PermissionError("credit notes are insert-only: issue another one")
