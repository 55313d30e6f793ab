"""An invoice as a page: what a project's members and billing viewers read in the portal
(billing systems read the same invoice from /api/v1/invoices/<id>/)."""

from __future__ import annotations

from functools import partial

from django.contrib.auth.decorators import login_required
from django.db.models import Count, F, Min, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import urlencode

from portal.accounts.access import visible_projects
from portal.billing.invoices import period_bounds
from portal.billing.models import Invoice
from portal.billing.pricing import format_money
from portal.catalog.sharing import LABELS, TIMESLICE


@login_required
def invoice_detail(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    invoice = (
        Invoice.objects.filter(pk=pk, project__slug=slug, project__in=visible_projects(request.user))
        .select_related("project")
        .first()
    )
    if invoice is None:
        raise Http404("No such invoice")
    money = partial(format_money, currency=invoice.currency)
    # Lines summed per tier, GPU model, share and price: an invoice may hold thousands of
    # intervals, the page shows what they add up to (the API and CSV give every one).
    summary = [
        {
            **row,
            "gpu_hours": row["gpu_seconds"] / 1000 / 3600,
            "cost": money(row["cost"]),
            "price": money(row["price_per_gpu_hour_micros"]),
            # No GPU held: a CPU-only tier's lines, priced per hour of each sandbox.
            "cpu_only": not row["milli_gpu"],
            "mode_label": LABELS.get(row["tier__sharing_mode"], row["tier__sharing_mode"]),
            "replicas": _replicas(row["tier__sharing_mode"], row["milli_gpu"]),
        }
        for row in invoice.lines.values(
            "tier__name", "tier__sharing_mode", "gpu_model", "milli_gpu", "price_per_gpu_hour_micros"
        )
        .annotate(
            intervals=Count("pk"),
            sandboxes=Count("sandbox_id", distinct=True),
            gpu_seconds=Sum(F("seconds") * F("milli_gpu")),
            cost=Sum("cost_micros"),
            first=Min("started_at"),
        )
        .order_by("tier__name", "gpu_model", "milli_gpu", "price_per_gpu_hour_micros")
    ]
    # What each kind of share billed here gives and does not (a time-slice replica is billed
    # as 1/N of a GPU-hour, which reserves none of it): once per mode and replica count.
    shares = sorted({(row["tier__sharing_mode"], row["replicas"]) for row in summary}, key=str)
    credit_notes = list(invoice.credit_notes.all())
    credited = sum(note.amount_micros for note in credit_notes)
    start, end = period_bounds(invoice.period_start)
    period = {"project": invoice.project.slug, "start": start.isoformat(), "end": end.isoformat()}
    return render(
        request,
        "billing/invoice.html",
        {
            "invoice": invoice,
            "project": invoice.project,
            "summary": summary,
            "shares": shares,
            "credit_notes": [(note, money(note.amount_micros)) for note in credit_notes],
            "total": money(invoice.total_micros),
            "credited": money(credited) if credited else None,
            "due": money(invoice.total_micros - credited),
            "csv_url": f"{reverse('api-usage-export')}?{urlencode(period)}",
            "api_url": reverse("api:invoice-detail", args=[invoice.pk]),
        },
    )


def _replicas(mode: str, milli_gpu: int) -> int | None:
    """A time-slice line's replica count: its GPU's thousandths are 1000 // replicas."""
    return round(1000 / milli_gpu) if mode == TIMESLICE and milli_gpu else None
