"""Does the client speak the portal's API? Its routes and request fields (the one table in
``gpushare_client/routes.py``) against an OpenAPI schema: the one the portal generates
(tests/cli/test_schema_agreement.py) and the one a running portal serves (the e2e test)."""

from __future__ import annotations

from typing import Any

from gpushare_client.routes import PREVIEW, REQUEST, REQUEST_COMPONENT, REQUEST_FIELDS, ROUTES

# The fields the client reads from each answer (commands.py, render.py, waiting.py).
READS = {
    "Sandbox": {
        "id", "name", "project", "owner", "tier", "image", "sharing_mode", "sharing_terms", "isolation",
        "state", "pending_reason", "launch_progress", "failure", "host", "gpu_count", "mig_profile",
        "mps_memory_mib", "mps_thread_pct", "max_duration_hours", "batch", "command", "requested_at",
        "started_at", "ended_at",
    },
    "Preview": {"verdict", "message", "host", "position", "earliest_start", "alternatives"},
    "SandboxEvent": {"id", "at", "from_state", "to_state", "actor", "message"},
    "SandboxEventPage": {"next", "results"},
    "Output": {"start", "end", "total", "text", "complete"},
    "Project": {"slug", "role"},
    "UsageRecord": {
        "sandbox", "project", "user", "tier", "gpu_model", "milli_gpu", "currency", "started_at", "ended_at",
        "duration_seconds", "cost_micros",
    },
    "Invoice": {
        "id", "number", "project", "period_start", "state", "total_micros", "currency", "finalized_at",
    },
    "InvoiceDetail": {"lines", "credit_notes"},
    "InvoiceLine": {"sandbox_id", "tier", "gpu_model", "started_at", "ended_at", "seconds", "cost_micros"},
    "CreditNote": {"number", "amount_micros", "reason"},
}  # fmt: skip


def _kind(schema: dict[str, Any], prop: dict[str, Any]) -> str:
    """A property's JSON type, following ``allOf: [{$ref: enum}]`` to the enum's."""
    for part in prop.get("allOf", []):
        if "$ref" in part:
            return _kind(schema, schema["components"]["schemas"][part["$ref"].rsplit("/", 1)[1]])
    if "$ref" in prop:
        return _kind(schema, schema["components"]["schemas"][prop["$ref"].rsplit("/", 1)[1]])
    return str(prop.get("type", "string"))


def mismatches(schema: dict[str, Any]) -> list[str]:
    """Every way the client and ``schema`` disagree; empty when they agree."""
    found: list[str] = []
    paths = schema["paths"]
    for route in ROUTES:
        if route.method.lower() not in paths.get(route.path, {}):
            found.append(f"{route.method} {route.path} is not in the schema")
    for route in (REQUEST, PREVIEW):
        operation = paths.get(route.path, {}).get(route.method.lower(), {})
        ref = (
            operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        )
        if ref.get("$ref") != f"#/components/schemas/{REQUEST_COMPONENT}":
            found.append(f"{route.method} {route.path} does not take {REQUEST_COMPONENT}: {ref}")
    components = schema["components"]["schemas"]
    component = components.get(REQUEST_COMPONENT, {})
    properties = component.get("properties", {})
    ours = {field.name: field for field in REQUEST_FIELDS}
    if missing := sorted(set(properties) - set(ours)):
        found.append(f"gpushare request has no option for {', '.join(missing)}")
    if extra := sorted(set(ours) - set(properties)):
        found.append(f"gpushare request sends fields the API does not take: {', '.join(extra)}")
    for name in sorted(set(ours) & set(properties)):
        theirs = _kind(schema, properties[name])
        if (theirs == "integer") != (ours[name].kind is int):
            found.append(f"{name}: the API takes {theirs}, gpushare request sends {ours[name].kind.__name__}")
    required = set(component.get("required", []))
    if required != {name for name, field in ours.items() if field.required}:
        found.append(f"required fields differ: the API's {sorted(required)}")
    for name, fields in READS.items():
        given = set(components.get(name, {}).get("properties", {}))
        if lacking := sorted(fields - given):
            found.append(f"{name} lacks {', '.join(lacking)}, which the client reads")
    return found
