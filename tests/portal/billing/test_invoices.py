"""Monthly invoices: drafts from the ledger, months split exactly, finalization freezes
(model and database), numbering, credit notes, the tick."""

from __future__ import annotations

import itertools
import threading
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, connections, transaction
from django.urls import reverse

from portal.billing import ledger
from portal.billing.invoices import (
    do_credit,
    do_draft_invoices,
    do_finalize,
    invoice_tick,
    part_cost_micros,
)
from portal.billing.models import (
    CreditNote,
    Invoice,
    InvoiceLine,
    InvoiceState,
    UsageRecord,
    cost_micros,
)
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint
from tests.portal.helpers import client_for, request

OCT, NOV = date(2026, 10, 1), date(2026, 11, 1)
PRICE, MILLI = 2_345_679, 333  # odd numbers: every part rounds


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


@pytest.fixture
def sandbox(people: Any, catalog: Any, sent_tasks: Any) -> Any:
    return request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])


def usage(sandbox: Any, start: datetime, end: datetime | None, key: str, project: Any = None) -> UsageRecord:
    """A ledger row as open_interval writes it, closed as close_interval does."""
    record = UsageRecord.objects.create(
        sandbox=sandbox,
        allocation_key=key,
        project=project or sandbox.project,
        user=sandbox.owner,
        tier=sandbox.tier,
        gpu_model="H100-80GB",
        milli_gpu=MILLI,
        price_per_gpu_hour_micros=PRICE,
        currency="EUR",
        started_at=start,
    )
    if end is not None:
        closed = ledger.close_interval(SimpleNamespace(allocation_key=key), end)  # type: ignore[arg-type]
        assert closed is not None
        record = closed
    return record


def ledger_total() -> int:
    return sum(r.cost_micros or 0 for r in UsageRecord.objects.all())


def invoice(period: date, project: Any) -> Invoice:
    return Invoice.objects.get(period_start=period, project=project, currency="EUR")


def test_drafts_sum_exactly_and_a_record_spanning_months_is_split(sandbox: Any, people: Any) -> None:
    inside = usage(sandbox, at(2026, 10, 3, 9, 0, 0, 123457), at(2026, 10, 3, 11, 7, 1, 999999), "a")
    spanning = usage(sandbox, at(2026, 10, 31, 22, 0, 0, 333333), at(2026, 11, 1, 3, 17, 0, 777777), "b")
    later = usage(sandbox, at(2026, 11, 5, 8), at(2026, 11, 5, 9, 30), "c")
    now = at(2026, 12, 10)
    do_draft_invoices(OCT, now)
    do_draft_invoices(NOV, now)
    oct_inv, nov_inv = invoice(OCT, people["project"]), invoice(NOV, people["project"])
    [oct_part] = oct_inv.lines.filter(usage_record=spanning)
    [nov_part] = nov_inv.lines.filter(usage_record=spanning)
    assert oct_part.ended_at == nov_part.started_at == at(2026, 11, 1)
    assert oct_part.cost_micros + nov_part.cost_micros == spanning.cost_micros
    assert spanning.duration is not None and spanning.cost_micros is not None
    assert inside.cost_micros is not None and later.cost_micros is not None
    whole = Decimal(spanning.duration // timedelta(microseconds=1)) / 1_000_000
    assert oct_part.seconds + nov_part.seconds == whole
    # The first part is priced alone, the second takes the remainder.
    assert oct_part.cost_micros == cost_micros(
        PRICE, MILLI, (at(2026, 11, 1) - spanning.started_at) // timedelta(microseconds=1)
    )
    assert oct_inv.total_micros == inside.cost_micros + oct_part.cost_micros
    assert nov_inv.total_micros == later.cost_micros + nov_part.cost_micros
    assert oct_inv.total_micros + nov_inv.total_micros == ledger_total()


def test_split_parts_telescope_for_many_boundaries(sandbox: Any) -> None:
    record = usage(sandbox, at(2026, 8, 31, 23, 59, 59, 999999), at(2026, 11, 2, 0, 0, 0, 1), "long")
    assert record.ended_at is not None
    cuts = [record.started_at, at(2026, 9, 1), at(2026, 10, 1), at(2026, 11, 1), record.ended_at]
    parts = [part_cost_micros(record, a, b) for a, b in itertools.pairwise(cuts)]
    assert sum(parts) == record.cost_micros


def test_open_interval_is_billed_to_month_end_and_the_rest_next_month(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 31, 23, 0), None, "open")
    do_draft_invoices(NOV, at(2026, 11, 10))  # running month: closed usage only
    assert not Invoice.objects.filter(period_start=NOV).exists()
    do_draft_invoices(OCT, at(2026, 11, 1, 0, 0, 1))
    [line] = invoice(OCT, people["project"]).lines.all()
    assert (line.started_at, line.ended_at, line.seconds) == (at(2026, 10, 31, 23), at(2026, 11, 1), 3600)
    closed = ledger.close_interval(SimpleNamespace(allocation_key="open"), at(2026, 11, 1, 2, 30))  # type: ignore[arg-type]
    assert closed is not None
    do_draft_invoices(NOV, at(2026, 11, 10))
    [rest] = invoice(NOV, people["project"]).lines.all()
    assert rest.started_at == at(2026, 11, 1) and rest.seconds == 9000
    assert line.cost_micros + rest.cost_micros == closed.cost_micros


def test_redrafting_is_idempotent_and_picks_up_new_usage(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    do_draft_invoices(OCT, at(2026, 10, 20))
    draft = invoice(OCT, people["project"])
    lines = list(draft.lines.values_list("pk", "cost_micros"))
    do_draft_invoices(OCT, at(2026, 10, 21))
    again = invoice(OCT, people["project"])
    assert again.pk == draft.pk and again.updated_at == draft.updated_at
    assert list(again.lines.values_list("pk", "cost_micros")) == lines
    usage(sandbox, at(2026, 10, 4, 9), at(2026, 10, 4, 9, 30), "b")
    do_draft_invoices(OCT, at(2026, 10, 22))
    again = invoice(OCT, people["project"])
    assert again.lines.count() == 2 and again.total_micros == ledger_total()


def test_invoices_are_per_project_and_currency(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 11), "b", project=people["other_project"])
    drafts = do_draft_invoices(OCT, at(2026, 11, 2))
    assert {d.project_id for d in drafts} == {people["project"].pk, people["other_project"].pk}
    with pytest.raises(ValidationError, match="first of a month"):
        do_draft_invoices(date(2026, 10, 2), at(2026, 11, 2))


def test_finalize_numbers_sequentially_and_freezes(sandbox: Any, people: Any, sent_tasks: Any) -> None:
    WebhookEndpoint.objects.create(url="http://127.0.0.1:9/hook", events=["invoice.finalized"])
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 11), "b", project=people["other_project"])
    do_draft_invoices(OCT, at(2026, 11, 5))
    first = do_finalize(invoice(OCT, people["project"]), people["admin"], at(2026, 11, 5))
    second = do_finalize(invoice(OCT, people["other_project"]), None, at(2026, 11, 5))
    assert (first.number, second.number) == ("GPS-202610-0001", "GPS-202610-0002")
    assert first.state == InvoiceState.FINALIZED and first.finalized_at == at(2026, 11, 5)
    assert do_finalize(first, None).number == "GPS-202610-0001"  # idempotent
    assert WebhookDelivery.objects.filter(event="invoice.finalized").count() == 2
    # Late usage for a finalized month does not reach the invoice.
    usage(sandbox, at(2026, 10, 9, 9), at(2026, 10, 9, 10), "late")
    do_draft_invoices(OCT, at(2026, 11, 6))
    assert invoice(OCT, people["project"]).lines.count() == 1
    first.total_micros = 1
    with pytest.raises(PermissionError):
        first.save()
    with pytest.raises(PermissionError):
        first.lines.get().save()
    with pytest.raises(PermissionError):
        first.delete()


def test_database_refuses_to_change_a_finalized_invoice(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    do_draft_invoices(OCT, at(2026, 11, 5))
    draft = invoice(OCT, people["project"])
    with connection.cursor() as cursor:  # a draft is still writable
        cursor.execute("UPDATE billing_invoice SET total_micros = total_micros WHERE id = %s", [draft.pk])
    done = do_finalize(draft, None)
    line = done.lines.get()
    statements = [
        ("UPDATE billing_invoice SET total_micros = 0 WHERE id = %s", done.pk),
        ("UPDATE billing_invoiceline SET cost_micros = 0 WHERE id = %s", line.pk),
    ]
    # SQLite's triggers refuse UPDATE only (Django's test teardown empties its tables with
    # DELETE; the models refuse deletes there): see migration billing 0002.
    if connection.vendor == "postgresql":
        statements += [
            ("DELETE FROM billing_invoice WHERE id = %s", done.pk),
            ("DELETE FROM billing_invoiceline WHERE id = %s", line.pk),
        ]
    for sql, pk in statements:
        with (
            pytest.raises(DatabaseError, match="finalized"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(sql, [pk])
    with pytest.raises(DatabaseError, match="finalized"), transaction.atomic():
        InvoiceLine.objects.bulk_create([InvoiceLine(**{**_line_values(line), "cost_micros": 5})])
    note = do_credit(done, 1, "goodwill", people["admin"])
    refused = ["UPDATE billing_creditnote SET amount_micros = 2 WHERE id = %s"]
    if connection.vendor == "postgresql":
        refused.append("DELETE FROM billing_creditnote WHERE id = %s")
    for sql in refused:
        with (
            pytest.raises(DatabaseError, match="insert-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(sql, [note.pk])
    assert Invoice.objects.get(pk=done.pk).total_micros == done.total_micros


def _line_values(line: InvoiceLine) -> dict[str, Any]:
    return {
        f.attname: getattr(line, f.attname)
        for f in InvoiceLine._meta.concrete_fields
        if f.attname not in {"id", "usage_record_id"}
    } | {
        "usage_record_id": UsageRecord.objects.exclude(pk=line.usage_record_id)
        .values_list("pk", flat=True)
        .first()
    }


def test_credit_notes_are_bounded_and_numbered(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    [draft] = do_draft_invoices(OCT, at(2026, 11, 5))
    with pytest.raises(ValidationError, match="only a finalized invoice"):
        do_credit(draft, 1, "too early", people["admin"])
    done = do_finalize(draft, None)
    total = done.total_micros
    assert total > 2
    with pytest.raises(ValidationError, match="exceeds what is left"):
        do_credit(done, total + 1, "too much", people["admin"])
    with pytest.raises(ValidationError, match="positive"):
        do_credit(done, 0, "nothing", people["admin"])
    with pytest.raises(ValidationError, match="reason"):
        do_credit(done, 1, "  ", people["admin"])
    now = at(2026, 11, 20)
    a = do_credit(done, total - 1, "outage on the 3rd", people["admin"], now)
    b = do_credit(done, 1, "rounding", None, now)
    assert (a.number, b.number) == ("GPS-CN-202611-0001", "GPS-CN-202611-0002")
    with pytest.raises(ValidationError, match=r"left uncredited on GPS-202610-0001 \(0\)"):
        do_credit(done, 1, "once more", people["admin"], now)
    assert done.credited_micros == total and CreditNote.objects.count() == 2
    with pytest.raises(PermissionError):
        a.delete()


def test_tick_drafts_then_finalizes_after_the_grace_period(sandbox: Any, people: Any, settings: Any) -> None:
    settings.INVOICE_FINALIZE_AFTER_DAYS = 3
    usage(sandbox, at(2026, 10, 31, 23), None, "open")
    usage(sandbox, at(2026, 11, 1, 1), at(2026, 11, 1, 2), "nov")
    cache.clear()
    assert invoice_tick(at(2026, 11, 2)) == {"drafted": 2, "finalized": 0}
    assert invoice(OCT, people["project"]).state == InvoiceState.DRAFT
    cache.clear()
    assert invoice_tick(at(2026, 11, 3, 23, 59)) == {"drafted": 2, "finalized": 0}
    result = invoice_tick(at(2026, 11, 4, 0, 0, 1))  # drafts throttled, finalization is not
    assert result == {"drafted": 0, "finalized": 1}
    done = invoice(OCT, people["project"])
    assert done.state == InvoiceState.FINALIZED and done.number == "GPS-202610-0001"
    assert done.lines.get().ended_at == at(2026, 11, 1)
    assert invoice_tick(at(2026, 11, 4, 0, 1)) == {"drafted": 0, "finalized": 0}
    assert invoice(NOV, people["project"]).state == InvoiceState.DRAFT


def _race(*calls: Any) -> list[Any]:
    """Run the calls at once in threads (each with its own connection); results or errors."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Any) -> None:
        try:
            barrier.wait()
            results[i] = call()
        except Exception as exc:
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.mark.races
@pytest.mark.django_db(transaction=True)  # threads race for the locks, each on its own connection
def test_concurrent_finalizations_and_credits_take_their_locks(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 11), "b", project=people["other_project"])
    one, two = do_draft_invoices(OCT, at(2026, 11, 5))
    done = _race(lambda: do_finalize(one, None), lambda: do_finalize(two, None))
    assert sorted(d.number for d in done) == ["GPS-202610-0001", "GPS-202610-0002"]
    big = Invoice.objects.get(pk=one.pk)
    more_than_half = big.total_micros // 2 + 1
    outcomes = _race(*[lambda: do_credit(big, more_than_half, "race", None) for _ in range(2)])
    assert sorted(type(o).__name__ for o in outcomes) == ["CreditNote", "ValidationError"]
    assert CreditNote.objects.filter(invoice=big).count() == 1


def test_admin_shows_invoices_and_finalizes_drafts(sandbox: Any, people: Any, sent_tasks: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    [draft] = do_draft_invoices(OCT, at(2026, 11, 5))
    admin = client_for(people["admin"])
    changelist = reverse("admin:billing_invoice_changelist")
    assert admin.get(changelist, {"state": "draft"}).status_code == 200
    response = admin.post(changelist, {"action": "finalize", "_selected_action": [draft.pk]})
    assert response.status_code == 302
    done = Invoice.objects.get(pk=draft.pk)
    assert done.number == "GPS-202610-0001"
    page = admin.get(reverse("admin:billing_invoice_change", args=[done.pk]))
    assert page.status_code == 200 and "GPS-202610-0001" in page.content.decode()


def test_project_members_read_the_invoice_page_and_outsiders_do_not(sandbox: Any, people: Any) -> None:
    usage(sandbox, at(2026, 10, 3, 9), at(2026, 10, 3, 10), "a")
    usage(sandbox, at(2026, 10, 4, 9), at(2026, 10, 4, 9, 30), "b")
    [draft] = do_draft_invoices(OCT, at(2026, 11, 5))
    done = do_finalize(draft, None, at(2026, 11, 5))
    do_credit(done, 1_000_000, "outage on the 3rd", people["admin"], at(2026, 11, 6))
    url = reverse("invoice-detail", args=["vision", done.pk])
    project_page = (
        client_for(people["member"]).get(reverse("project-detail", args=["vision"])).content.decode()
    )
    assert url in project_page and "GPS-202610-0001" in project_page and "1.00 EUR" in project_page
    page = client_for(people["member"]).get(url).content.decode()
    total = done.total_micros / 1_000_000
    # One summary row for both intervals (same tier, model, share and price): 1.5 h x 0.333 GPU.
    assert "GPS-202610-0001" in page and "0.500" in page and f"{total:,.2f} EUR" in page
    assert "outage on the 3rd" in page and f"{total - 1:,.2f} EUR" in page  # due after the credit
    assert client_for(people["outsider"]).get(url).status_code == 404
    # The same invoice under another project's slug does not exist either.
    assert (
        client_for(people["admin"]).get(reverse("invoice-detail", args=["nlp", done.pk])).status_code == 404
    )
