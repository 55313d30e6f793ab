"""A billing team's outside client, knowing only the OpenAPI schema and a token, fetches a
month's invoice over HTTP from a real server and reconciles it to the usage records."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.billing.invoices import do_draft_invoices, do_finalize
from portal.billing.models import Invoice
from tests.e2e.platform import Platform
from tests.portal.billing.test_invoices import usage

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
CLIENT = Path(__file__).resolve().parents[1] / "clients" / "reconcile_invoice.py"
OCT = date(2026, 10, 1)


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def test_an_outside_client_reconciles_a_month(
    tmp_path: Path, people: Any, catalog: Any, sent_tasks: Any
) -> None:
    from tests.portal.helpers import request

    box = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    other = request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    usage(box, at(2026, 9, 30, 22), at(2026, 10, 1, 3, 15), "k-cross-in")  # crosses into October
    for day in range(1, 28, 3):  # wholly inside October, odd lengths so every cost rounds
        usage(box, at(2026, 10, day, 8), at(2026, 10, day, 9, 17, 11, 123457), f"k-{day}")
    usage(box, at(2026, 10, 31, 23), at(2026, 11, 1, 0, 40), "k-cross-out")  # crosses into November
    usage(other, at(2026, 10, 5), at(2026, 10, 6), "k-other")  # another project's: not on this invoice
    do_draft_invoices(OCT, at(2026, 11, 10))
    do_finalize(Invoice.objects.get(project=people["project"], period_start=OCT), None, at(2026, 11, 10))
    _, token = ApiToken.issue(people["owner"], "billing system", ["read:usage"])
    (tmp_path / "logs").mkdir()
    platform = Platform(tmp_path / "var", tmp_path / "logs")
    try:
        base = platform.start_web()
        # The client is another program: no gpushare import path, only the URL and the token.
        done = subprocess.run(
            [sys.executable, "-I", str(CLIENT), base, token, people["project"].slug, "2026-10"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    finally:
        platform.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["lines"] == report["usage_records"] == 11, report
    assert report["total_micros"] == Invoice.objects.get(project=people["project"]).total_micros
