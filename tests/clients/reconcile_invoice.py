"""An outside billing client: it knows the OpenAPI schema's address and an API token, nothing
of gpushare's code. Standard library only, as a billing team's script would be.

    python reconcile_invoice.py BASE_URL TOKEN PROJECT YYYY-MM

It finds the operations it needs in the schema by their ``operationId``, fetches the
project's finalized invoice of the month with its lines, pages through the project's usage
records (cursor pages, following ``next``), and reconciles the two:

- the invoice total is the sum of its lines;
- every line belongs to a usage record of the project, and covers exactly the part of that
  record inside the month (its seconds);
- every closed usage record that overlaps the month has exactly one line;
- a record wholly inside the month costs exactly what its line says; a record crossing a
  month boundary is billed in parts, the month's part never above the record's cost.

It prints a JSON report and exits 1 when anything does not reconcile.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base = base.rstrip("/")
        self.token = token
        schema = self.get(f"{self.base}/api/schema/?format=json")
        self.paths = {
            op["operationId"]: path
            for path, ops in schema["paths"].items()
            for method, op in ops.items()
            if method == "get"
        }

    def get(self, url: str) -> Any:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"not an HTTP URL: {url}")
        request = urllib.request.Request(  # noqa: S310 - the scheme is checked above
            url, headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the scheme is checked above
            return json.loads(response.read())

    def url(self, operation: str, query: dict[str, str] | None = None, **path_args: Any) -> str:
        path = self.paths[operation]
        for name, value in path_args.items():
            path = path.replace("{" + name + "}", urllib.parse.quote(str(value)))
        return self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")

    def every(self, operation: str, query: dict[str, str]) -> list[dict[str, Any]]:
        """All results of a cursor-paginated list."""
        rows: list[dict[str, Any]] = []
        url: str | None = self.url(operation, query)
        while url:
            page = self.get(url)
            rows += page["results"]
            url = page.get("next")
        return rows


def parse(when: str | None) -> datetime | None:
    return datetime.fromisoformat(when.replace("Z", "+00:00")) if when else None


def reconcile(base: str, token: str, project: str, month: str) -> dict[str, Any]:
    api = Api(base, token)
    year, mon = (int(x) for x in month.split("-"))
    month_start = datetime(year, mon, 1, tzinfo=UTC)
    month_end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=UTC)
    problems: list[str] = []
    invoices = api.every("v1_invoices_list", {"project": project, "period": month, "state": "finalized"})
    if len(invoices) != 1:
        return {"ok": False, "problems": [f"expected one finalized invoice, found {len(invoices)}"]}
    invoice = api.get(api.url("v1_invoices_retrieve", id=invoices[0]["id"]))
    lines = invoice["lines"]
    if sum(line["cost_micros"] for line in lines) != invoice["total_micros"]:
        problems.append("the invoice total is not the sum of its lines")
    # Usage that started before the month's end; the ones that ended before it began are not billed.
    records = api.every("v1_usage_list", {"project": project, "end": month_end.isoformat()})
    overlapping = {
        r["id"]: r
        for r in records
        if r["ended_at"] is not None and parse(r["ended_at"]) > month_start  # type: ignore[operator]
    }
    by_record: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_record.setdefault(line["usage_record"], []).append(line)
    for record_id, record in overlapping.items():
        found = by_record.get(record_id, [])
        if len(found) != 1:
            problems.append(f"usage record {record_id} has {len(found)} lines")
            continue
        line = found[0]
        start, end = parse(record["started_at"]), parse(record["ended_at"])
        assert start is not None and end is not None
        inside = (min(end, month_end) - max(start, month_start)).total_seconds()
        if Decimal(str(line["seconds"])) != Decimal(str(round(inside, 6))):
            problems.append(f"record {record_id}: line has {line['seconds']} s, the month holds {inside} s")
        whole = month_start <= start and end <= month_end
        if whole and line["cost_micros"] != record["cost_micros"]:
            problems.append(
                f"record {record_id}: line {line['cost_micros']} ≠ record {record['cost_micros']}"
            )
        if not whole and not 0 <= line["cost_micros"] <= record["cost_micros"]:
            problems.append(
                f"record {record_id}: part {line['cost_micros']} outside 0..{record['cost_micros']}"
            )
    for record_id in set(by_record) - set(overlapping):
        problems.append(f"line for usage record {record_id}, which is not the project's usage in {month}")
    return {
        "ok": not problems,
        "invoice": invoice["number"],
        "total_micros": invoice["total_micros"],
        "currency": invoice["currency"],
        "lines": len(lines),
        "usage_records": len(overlapping),
        "problems": problems,
    }


if __name__ == "__main__":
    report = reconcile(*sys.argv[1:5])
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)
