"""The client is built on the portal's OpenAPI schema: each route it calls and each field of
``gpushare request`` is the schema's (tests/cli/schema_check.py), and a change to either
side without the other fails here. The terminal's WebSocket, which OpenAPI does not
describe, is checked against the token routes themselves."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator
from gpushare_client.routes import REQUEST_COMPONENT, REQUEST_FIELDS, ROUTES, TERMINAL_SOCKET

from portal.routing import token_websocket_urlpatterns
from tests.cli.schema_check import mismatches


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return SchemaGenerator().get_schema(request=None, public=True)


def test_every_route_and_request_field_is_the_schemas(schema: dict[str, Any]) -> None:
    assert mismatches(schema) == []
    assert len(ROUTES) == len(set(ROUTES)) >= 12


def test_the_check_notices_a_drift(schema: dict[str, Any]) -> None:
    """What a renamed field or a dropped route on either side looks like to the check."""
    drifted = copy.deepcopy(schema)
    component = drifted["components"]["schemas"][REQUEST_COMPONENT]["properties"]
    component["gpus"] = component.pop("gpu_count")
    component["duration_hours"] = {"type": "string"}
    del drifted["paths"]["/api/v1/sandboxes/{id}/events/"]
    del drifted["components"]["schemas"]["Sandbox"]["properties"]["launch_progress"]
    assert mismatches(drifted) == [
        "GET /api/v1/sandboxes/{id}/events/ is not in the schema",
        "gpushare request has no option for gpus",
        "gpushare request sends fields the API does not take: gpu_count",
        "duration_hours: the API takes string, gpushare request sends int",
        "Sandbox lacks launch_progress, which the client reads",
    ]


def test_the_options_are_named_for_people_and_unique() -> None:
    options = [field.option for field in REQUEST_FIELDS]
    assert len(set(options)) == len(options) and all(o.startswith("--") for o in options)
    assert {"--wait", "--timeout", "--dry-run", "--json"}.isdisjoint(options)


def test_the_terminal_socket_is_a_route_that_takes_tokens() -> None:
    path = TERMINAL_SOCKET.format(id=42).lstrip("/")
    [matched] = [p for p in token_websocket_urlpatterns if p.pattern.match(path)][:1]
    assert matched.pattern.match(path)[2] == {"sandbox_id": 42}
    assert "terminal" in str(matched.pattern)
