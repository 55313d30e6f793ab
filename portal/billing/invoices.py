"""Monthly invoices from the usage ledger: drafted, finalized (frozen), corrected by credit
notes. Every change goes through the ``do_*`` functions here.

What a month bills (UTC calendar months):

* every usage interval overlapping the month, clipped to it; an interval spanning months
  is cut at the boundaries and each part priced by telescoping the ledger's own cost
  function (see ``part_cost_micros``), so the parts sum exactly to the record's cost;
* an interval still open is billed only for months that are over, up to the month's end
  (its later part goes to the month in which it closes, or to the next month that ends
  first): a draft of the running month holds closed usage only;
* zero-length parts (an interval ending exactly at midnight on the first) make no line.

Usage that reaches a month whose invoice is already finalized (a backdated interval) is
not added to it: it is logged and left for a credit note or a manual correction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from portal.billing.models import (
    CreditNote,
    Invoice,
    InvoiceLine,
    InvoiceState,
    UsageRecord,
    cost_micros,
)
from portal.webhooks.deliveries import emit
from portal.webhooks.models import WebhookEvent

log = logging.getLogger(__name__)
_MICROSECOND = timedelta(microseconds=1)
# Fields of a line that a refreshed draft may change.
_LINE_FIELDS = (
    "sandbox_id",
    "tier_id",
    "gpu_model",
    "milli_gpu",
    "price_per_gpu_hour_micros",
    "started_at",
    "ended_at",
    "seconds",
    "cost_micros",
)
# Advisory-lock namespaces (PostgreSQL): numbering is serialised per month.
_LOCK_INVOICE_NUMBER = 0x47505300
_LOCK_CREDIT_NUMBER = 0x47504300


def month_start(when: date | datetime) -> date:
    if isinstance(when, datetime):
        when = when.astimezone(UTC).date()
    return when.replace(day=1)


def next_month(period_start: date) -> date:
    return (period_start.replace(day=28) + timedelta(days=4)).replace(day=1)


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


def period_bounds(period_start: date) -> tuple[datetime, datetime]:
    """[first instant of the month, first instant of the next), in UTC."""
    if period_start.day != 1:
        raise ValidationError(f"a billing period starts on the first of a month, not on {period_start}")
    return _midnight(period_start), _midnight(next_month(period_start))


def part_cost_micros(record: UsageRecord, part_start: datetime, part_end: datetime) -> int:
    """Cost of ``[part_start, part_end)`` of ``record``: C(end - start of record) minus
    C(start - start of record), C being ``cost_micros`` on whole microseconds, as the
    ledger prices a closed interval. Consecutive parts telescope to C(duration), so
    however rounding falls the parts of a record add up to its ``cost_micros``."""

    def c(until: datetime) -> int:
        return cost_micros(
            record.price_per_gpu_hour_micros, record.priced_milli, (until - record.started_at) // _MICROSECOND
        )

    if record.ended_at is not None and part_end == record.ended_at and record.cost_micros is not None:
        return record.cost_micros - c(part_start)  # the last part takes the remainder
    return c(part_end) - c(part_start)


@dataclass(frozen=True)
class LinePart:
    record: UsageRecord
    started_at: datetime
    ended_at: datetime

    @property
    def seconds(self) -> Decimal:
        return Decimal((self.ended_at - self.started_at) // _MICROSECOND) / Decimal(1_000_000)

    def values(self) -> dict[str, Any]:
        r = self.record
        return {
            "sandbox_id": r.sandbox_id,
            "tier_id": r.tier_id,
            "gpu_model": r.gpu_model,
            "milli_gpu": r.milli_gpu,
            "price_per_gpu_hour_micros": r.price_per_gpu_hour_micros,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "seconds": self.seconds,
            "cost_micros": part_cost_micros(r, self.started_at, self.ended_at),
        }


def billable_parts(period_start: date, now: datetime) -> dict[tuple[int, str], list[LinePart]]:
    """What the month bills, by (project id, currency), per the rules in the module docstring."""
    start, end = period_bounds(period_start)
    month_over = now >= end
    overlapping = Q(ended_at__gt=start) | (Q(ended_at__isnull=True) if month_over else Q(pk__in=[]))
    records = UsageRecord.objects.filter(Q(started_at__lt=end) & overlapping).order_by("started_at", "pk")
    parts: dict[tuple[int, str], list[LinePart]] = {}
    for record in records:
        part_start = max(record.started_at, start)
        part_end = min(record.ended_at or end, end)
        if part_end <= part_start:
            continue
        parts.setdefault((record.project_id, record.currency), []).append(
            LinePart(record, part_start, part_end)
        )
    return parts


def do_draft_invoices(period_start: date, now: datetime | None = None) -> list[Invoice]:
    """Build or refresh the draft invoice of every project (and currency) with usage in the
    month starting ``period_start``. Idempotent: a second run with the same ledger changes
    nothing. Finalized invoices are left alone. Locks each invoice row (select_for_update)
    while its lines are rewritten, so a concurrent finalize waits or sees the old draft."""
    now = now or timezone.now()
    period_bounds(period_start)  # validates the date
    wanted = billable_parts(period_start, now)
    drafts: list[Invoice] = []
    for (project_id, currency), parts in sorted(wanted.items()):
        invoice = _refresh_draft(project_id, currency, period_start, parts, now)
        if invoice is not None:
            drafts.append(invoice)
    # Drafts whose usage is gone (none should be, the ledger is append-only) are dropped.
    stale = Invoice.objects.filter(period_start=period_start, state=InvoiceState.DRAFT).exclude(
        pk__in=[d.pk for d in drafts]
    )
    for invoice in stale:
        with transaction.atomic():
            locked = (
                Invoice.objects.select_for_update().filter(pk=invoice.pk, state=InvoiceState.DRAFT).first()
            )
            if locked is not None and (locked.project_id, locked.currency) not in wanted:
                locked.delete()
    return drafts


def _refresh_draft(
    project_id: int, currency: str, period_start: date, parts: list[LinePart], now: datetime
) -> Invoice | None:
    with transaction.atomic():
        invoice, _ = Invoice.objects.get_or_create(
            project_id=project_id, period_start=period_start, currency=currency
        )
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if invoice.state == InvoiceState.FINALIZED:
            billed = set(invoice.lines.values_list("usage_record_id", flat=True))
            late = [p.record.pk for p in parts if p.record.pk not in billed]
            if late:
                log.warning(
                    "invoice %s is finalized; usage records %s for its month are not on it",
                    invoice.number,
                    late,
                )
            return None
        existing = {line.usage_record_id: line for line in invoice.lines.all()}
        keep: set[int] = set()
        new_lines: list[InvoiceLine] = []
        for part in parts:
            values = part.values()
            keep.add(part.record.pk)
            line = existing.get(part.record.pk)
            if line is None:
                new_lines.append(InvoiceLine(invoice=invoice, usage_record=part.record, **values))
            elif any(getattr(line, k) != v for k, v in values.items()):
                for k, v in values.items():
                    setattr(line, k, v)
                line.save(update_fields=list(_LINE_FIELDS))
        InvoiceLine.objects.bulk_create(new_lines)
        gone = [line.pk for rid, line in existing.items() if rid not in keep]
        if gone:
            InvoiceLine.objects.filter(pk__in=gone).delete()
        total = sum(p.values()["cost_micros"] for p in parts)
        if new_lines or gone or total != invoice.total_micros:
            invoice.total_micros = total
            invoice.updated_at = now
            invoice.save(update_fields=["total_micros", "updated_at"])
        return invoice


def _advisory_lock(namespace: int, period: date) -> None:
    """Serialise numbering within a month (PostgreSQL; SQLite serialises writers anyway)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)", [namespace, period.year * 100 + period.month]
            )


def _next_number(prefix: str, taken: list[str | None]) -> str:
    last = max((int(n.rsplit("-", 1)[1]) for n in taken if n), default=0)
    return f"{prefix}-{last + 1:04d}"


def do_finalize(invoice: Invoice, actor: Any = None, now: datetime | None = None) -> Invoice:
    """Number and freeze a draft, and emit ``invoice.finalized``. Idempotent: finalizing a
    finalized invoice returns it unchanged. Takes the invoice row lock and the month's
    numbering lock (advisory), so numbers are sequential per month without gaps."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = Invoice.objects.select_for_update().select_related("project").get(pk=invoice.pk)
        if locked.state == InvoiceState.FINALIZED:
            return locked
        _advisory_lock(_LOCK_INVOICE_NUMBER, locked.period_start)
        prefix = f"GPS-{locked.period_start:%Y%m}"
        taken = list(Invoice.objects.filter(number__startswith=prefix + "-").values_list("number", flat=True))
        locked.number = _next_number(prefix, taken)
        locked.total_micros = sum(locked.lines.values_list("cost_micros", flat=True))
        locked.state = InvoiceState.FINALIZED
        locked.finalized_at = now
        locked.updated_at = now
        locked.save(update_fields=["number", "total_micros", "state", "finalized_at", "updated_at"])
        log.info("invoice %s finalized by %s", locked.number, getattr(actor, "username", "system"))
        emit(
            WebhookEvent.INVOICE_FINALIZED,
            invoice_payload(locked),
            locked.project_id,
            key=f"invoice.finalized:{locked.pk}",
        )
    return locked


def invoice_payload(invoice: Invoice) -> dict[str, Any]:
    return {
        "invoice_id": invoice.pk,
        "number": invoice.number,
        "project": invoice.project.slug,
        "project_id": invoice.project_id,
        "period_start": invoice.period_start.isoformat(),
        "currency": invoice.currency,
        "total_micros": invoice.total_micros,
        "lines": invoice.lines.count(),
        "finalized_at": invoice.finalized_at.isoformat() if invoice.finalized_at else None,
    }


def do_credit(
    invoice: Invoice, amount_micros: int, reason: str, actor: Any = None, now: datetime | None = None
) -> CreditNote:
    """Issue a credit note against a finalized invoice; together the notes never exceed
    its total. Locks the invoice row, so two concurrent credits cannot both fit."""
    now = now or timezone.now()
    reason = (reason or "").strip()
    if not reason:
        raise ValidationError({"reason": "a credit note needs a reason"})
    if not isinstance(amount_micros, int) or isinstance(amount_micros, bool) or amount_micros <= 0:
        raise ValidationError(
            {"amount_micros": f"must be a positive whole number of micros, not {amount_micros!r}"}
        )
    with transaction.atomic():
        locked = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if locked.state != InvoiceState.FINALIZED:
            raise ValidationError("only a finalized invoice can be credited: change the draft instead")
        left = locked.total_micros - locked.credited_micros
        if amount_micros > left:
            raise ValidationError(
                {
                    "amount_micros": (
                        f"{amount_micros} exceeds what is left uncredited on {locked.number} ({left})"
                    )
                }
            )
        month = month_start(now)
        _advisory_lock(_LOCK_CREDIT_NUMBER, month)
        prefix = f"GPS-CN-{month:%Y%m}"
        taken = list(
            CreditNote.objects.filter(number__startswith=prefix + "-").values_list("number", flat=True)
        )
        return CreditNote.objects.create(
            invoice=locked,
            number=_next_number(prefix, list(taken)),
            reason=reason[:300],
            amount_micros=amount_micros,
            created_at=now,
            created_by=actor if getattr(actor, "pk", None) else None,
        )


def finalize_after_days() -> int:
    return int(getattr(settings, "INVOICE_FINALIZE_AFTER_DAYS", 3))


def draft_refresh_seconds() -> int:
    return int(getattr(settings, "INVOICE_DRAFT_REFRESH_SECONDS", 600))


DRAFT_REFRESH_KEY = "billing:invoice-tick:drafts"


def invoice_tick(now: datetime) -> dict[str, int]:
    """Called from the control worker's periodic tick.

    At most every INVOICE_DRAFT_REFRESH_SECONDS (per process; drafting scans a month of
    usage): refresh the drafts of the running month, and of the month just ended while its
    grace period lasts or while it has no invoice at all. Every tick: finalize the drafts
    of each month that ended more than INVOICE_FINALIZE_AFTER_DAYS ago, drafting that month
    one last time first so usage still open at its end is billed up to midnight. Safe to
    run often and from several workers: each step is idempotent and locks what it changes.
    """
    current = month_start(now)
    previous = month_start(current - timedelta(days=1))
    grace = timedelta(days=finalize_after_days())
    drafted = 0
    if cache.add(DRAFT_REFRESH_KEY, 1, draft_refresh_seconds()):
        drafted += len(do_draft_invoices(current, now))
        if now < _midnight(current) + grace or not Invoice.objects.filter(period_start=previous).exists():
            drafted += len(do_draft_invoices(previous, now))
    due = Invoice.objects.filter(state=InvoiceState.DRAFT, period_start__lt=current)
    finalized = 0
    for period in sorted(set(due.values_list("period_start", flat=True))):
        if now < _midnight(next_month(period)) + grace:
            continue
        do_draft_invoices(period, now)
        for invoice in Invoice.objects.filter(period_start=period, state=InvoiceState.DRAFT).order_by("pk"):
            do_finalize(invoice, None, now)
            finalized += 1
    return {"drafted": drafted, "finalized": finalized}
