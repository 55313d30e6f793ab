"""A stand-in for the portal's REST API, for the client's fast tests: the answers the real
API gives (their shapes are the schema's: tests/cli/test_schema_agreement.py checks the
client's routes against it, and the e2e test runs the client against the real portal),
served through httpx's MockTransport. It records every request it was sent."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from portal.catalog.sharing import terms

TOKEN = "gps_the-right-token"
BASE = "http://portal.test"


def page(results: list[Any], following: str | None = None) -> dict[str, Any]:
    return {"next": following, "previous": None, "results": results}


def sandbox(pk: int = 7, **fields: Any) -> dict[str, Any]:
    mode = fields.get("sharing_mode", "dedicated")
    return {"sharing_terms": terms(mode).text, **_sandbox(pk, **fields)}


def _sandbox(pk: int, **fields: Any) -> dict[str, Any]:
    return {
        "id": pk, "name": "", "project": "vision", "owner": "olivia", "tier": "dedicated", "image": "busybox",
        "sharing_mode": "dedicated", "isolation": "container", "state": "queued",
        "pending_reason": "waiting for the scheduler", "launch_progress": "", "failure": "", "host": None,
        "attempt": 1,
        "gpu_count": 1, "mig_profile": "", "mps_memory_mib": 0, "mps_thread_pct": 0,
        "max_duration_hours": 1.0,
        "batch": False, "command": [], "requested_at": "2026-11-28T10:00:00.123456Z", "started_at": None,
        "ended_at": None, **fields,
    }  # fmt: skip


EVENTS = [
    {"id": 1, "at": "2026-11-28T10:00:00Z", "from_state": "", "to_state": "requested", "actor": "olivia",
     "message": "requested 1 GPU on Dedicated"},
    {"id": 2, "at": "2026-11-28T10:00:01Z", "from_state": "requested", "to_state": "queued",
     "actor": "olivia", "message": "waiting for the scheduler"},
    {"id": 3, "at": "2026-11-28T10:00:02Z", "from_state": "queued", "to_state": "running", "actor": None,
     "message": "running (docker)"},
]  # fmt: skip
ATTEMPTS = [
    {"number": 1, "host": "h1", "placed_at": "2026-11-28T10:00:02Z", "ended_at": "2026-11-28T10:30:00Z",
     "end": "preempted", "end_message": "preempted for sandbox 9; queued again, as its tier says",
     "current": False},
    {"number": 2, "host": "h2", "placed_at": "2026-11-28T11:00:00Z", "ended_at": None, "end": "",
     "end_message": "", "current": True},
]  # fmt: skip
USAGE = {
    "id": 1, "sandbox": 7, "allocation_key": "k", "project": "vision", "user": "olivia", "tier": "dedicated",
    "gpu_model": "H100-80GB", "milli_gpu": 1000, "billed_milli": 1000, "price_per_gpu_hour_micros": 2500000,
    "currency": "EUR", "started_at": "2026-11-01T10:00:00Z", "ended_at": "2026-11-01T11:00:00Z",
    "duration_seconds": 3600.0, "cost_micros": 2500000,
}  # fmt: skip
INVOICE = {
    "id": 3, "number": "VIS-2026-10", "project": "vision", "period_start": "2026-10-01", "currency": "EUR",
    "state": "finalized", "total_micros": 2500000, "created_at": "2026-11-01T00:00:00Z",
    "finalized_at": "2026-11-02T00:00:00Z",
}  # fmt: skip


STARTS_NOW = {
    "verdict": "now", "message": "starts now on h1", "host": "h1", "position": 0, "earliest_start": None,
    "alternatives": [],
}  # fmt: skip
INVOICE_LINE = {
    "id": 1, "usage_record": 1, "sandbox_id": 7, "tier": "dedicated", "gpu_model": "H100-80GB",
    "milli_gpu": 1000, "price_per_gpu_hour_micros": 2500000, "started_at": "2026-10-01T10:00:00Z",
    "ended_at": "2026-10-01T11:00:00Z", "seconds": "3600.000000", "cost_micros": 2500000,
}  # fmt: skip


@dataclass
class FakePortal:
    """Routes by (method, path). ``states``: what successive reads of sandbox 7 answer."""

    states: list[dict[str, Any]] = field(default_factory=lambda: [sandbox(state="running", host="h1")])
    preview: dict[str, Any] = field(default_factory=lambda: dict(STARTS_NOW))
    # What the batch has printed so far, at successive reads of its output.
    output: list[str] = field(default_factory=lambda: ["hello\n"])
    overrides: dict[tuple[str, str], Callable[[httpx.Request], httpx.Response]] = field(default_factory=dict)
    seen: list[tuple[str, str, Any]] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.method, request.url.path, body))
        key = (request.method, request.url.path)
        if key in self.overrides:
            return self.overrides[key](request)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return httpx.Response(401, json={"detail": "Invalid or revoked API token."})
        if request.method == "POST" and not request.headers.get("Idempotency-Key"):
            return httpx.Response(400, json={"Idempotency-Key": ["The client always sends one."]})
        return self.route(request, body)

    def route(self, request: httpx.Request, body: Any) -> httpx.Response:
        path, method = request.url.path, request.method
        if (method, path) == ("GET", "/api/v1/projects/"):
            return httpx.Response(200, json=page([{"slug": "vision", "name": "Vision", "role": "manager",
                                                   "created_at": "2026-01-01T00:00:00Z"}]))  # fmt: skip
        if (method, path) in (("POST", "/api/v1/sandboxes/preview/"), ("POST", "/api/v1/sandboxes/")):
            if body.get("tier") not in ("dedicated", "mig"):
                return httpx.Response(400, json={"tier": ["No such open tier."]})
            if path.endswith("/preview/"):
                return httpx.Response(200, json=self.preview)
            return httpx.Response(
                201, json=sandbox(name=body.get("name", ""), batch=body.get("run") == "batch")
            )
        if (method, path) == ("GET", "/api/v1/sandboxes/"):
            if request.url.params.get("cursor") == "2":
                return httpx.Response(200, json=page([sandbox(5)]))
            return httpx.Response(
                200, json=page([sandbox(7), sandbox(6)], f"{BASE}/api/v1/sandboxes/?cursor=2")
            )
        if (method, path) == ("GET", "/api/v1/sandboxes/7/"):
            current = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return httpx.Response(200, json=current)
        if (method, path) == ("GET", "/api/v1/sandboxes/7/events/"):
            return httpx.Response(200, json=page(EVENTS))
        if (method, path) == ("GET", "/api/v1/sandboxes/7/attempts/"):
            return httpx.Response(200, json=ATTEMPTS)
        if (method, path) == ("GET", "/api/v1/sandboxes/7/output/") and request.url.params.get("attempt"):
            text = "step 1\nstep 2\n"
            piece = {"start": 0, "end": len(text), "kept_from": 0, "total": len(text), "missing": 0,
                     "text": text, "complete": True}  # fmt: skip
            return httpx.Response(200, json=piece)
        if (method, path) == ("GET", "/api/v1/sandboxes/7/output/"):
            offset = int(request.url.params.get("offset", "0"))
            text = self.output.pop(0) if len(self.output) > 1 else self.output[0]
            start = min(offset, len(text))
            piece = {"start": start, "end": len(text), "kept_from": 0, "total": len(text), "missing": 0,
                     "text": text[start:], "complete": True}  # fmt: skip
            return httpx.Response(200, json=piece)
        if (method, path) == ("POST", "/api/v1/sandboxes/7/extend/"):
            if body.get("hours") not in (1, 2, 4, 8):
                return httpx.Response(400, json={"hours": ["Give one of: 1, 2, 4, 8."]})
            return httpx.Response(200, json=sandbox(state="running", max_duration_hours=1.0 + body["hours"]))
        if (method, path) == ("POST", "/api/v1/sandboxes/7/stop/"):
            return httpx.Response(200, json=sandbox(state="stopping"))
        if (method, path) == ("GET", "/api/v1/usage/"):
            return httpx.Response(
                200, json=page([USAGE, {**USAGE, "id": 2, "ended_at": None, "cost_micros": None}])
            )
        if (method, path) == ("GET", "/api/v1/invoices/"):
            return httpx.Response(200, json=page([INVOICE]))
        if (method, path) == ("GET", "/api/v1/invoices/3/"):
            return httpx.Response(200, json={**INVOICE, "lines": [INVOICE_LINE], "credit_notes": []})
        return httpx.Response(404, json={"detail": "No Sandbox matches the given query."})
