"""Property-based API tests: schemathesis generates requests from /api/schema/ and calls
the WSGI app in-process, against the test database, with a token holding every scope.
No answer may be a 5xx, and every answer must match the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.cache import cache
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from portal.accounts.models import ApiToken
from portal.api.schema import SchemaView
from portal.sandboxes import actions
from tests.portal.helpers import place_all, request

EXAMPLES_PER_OPERATION = 100  # 13 operations: about 1,300 cases, a minute or two
MIN_CASES = 1000


@pytest.fixture
def api_key(people: Any, catalog: Any, fleet: Any, sent_tasks: Any, settings: Any) -> Iterator[str]:
    # Rate limits are tested in test_api.py; here they would only turn answers into 429s.
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "100000/min", "sustained": "1000000/hour"},
    }
    ran = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    ran.refresh_from_db()
    actions.do_mark_running(ran.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    request(people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="1g.10gb")
    _, key = ApiToken.issue(people["owner"], "schemathesis", list(ApiToken.Scope.values))
    yield key
    # Generated cases send forged tokens, counted per address (127.0.0.1): left in the cache,
    # the count would lock the next tests' valid tokens out with 429s.
    cache.clear()


@pytest.fixture
def wsgi_app() -> Any:
    """The WSGI app, without closing the test's database connection after each request
    (Django's test client does the same: the test transaction must survive the calls)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield get_wsgi_application()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generated_requests_get_schema_conformant_answers(api_key: str, wsgi_app: Any) -> None:
    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
    headers = {"Authorization": f"Bearer {api_key}"}
    cases = 0
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 12, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @hypothesis_settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases on every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def run(case: Any) -> None:
            nonlocal cases
            cases += 1
            response = case.call(headers=headers)
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

        run()
    print(f"schemathesis: {cases} cases over {len(operations)} operations")
    assert cases >= MIN_CASES


@pytest.mark.django_db
def test_the_schema_is_generated_once_per_format_and_served_the_same(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SchemaView, "_schema", {})
    monkeypatch.setattr(SchemaView, "_rendered", {})
    generated: list[int] = []
    real = SchemaGenerator.get_schema

    def counted(self: SchemaGenerator, **kwargs: Any) -> Any:
        generated.append(1)
        return real(self, **kwargs)

    monkeypatch.setattr(SchemaGenerator, "get_schema", counted)
    yaml1, yaml2 = client.get("/api/schema/"), client.get("/api/schema/")
    json1, json2 = (
        client.get("/api/schema/?format=json"),
        client.get("/api/schema/", HTTP_ACCEPT="application/json"),
    )
    assert len(generated) == 1  # rendered once per format; the repeats came from memory
    assert len(SchemaView._rendered) == 3  # YAML, JSON, and JSON asked for as application/json
    assert (
        yaml1.content == yaml2.content
        and yaml1["Content-Type"] == "application/vnd.oai.openapi; charset=utf-8"
    )
    assert json1.content == json2.content and json1["Content-Type"].startswith(
        "application/vnd.oai.openapi+json"
    )
    assert json2["Content-Type"].startswith("application/json")
    assert b"/api/v1/sandboxes/" in yaml1.content and json1.json()["paths"]["/api/v1/sandboxes/"]
    assert yaml1["Content-Disposition"] == 'inline; filename="gpushare API.yaml"'
    assert json1["Content-Disposition"] == 'inline; filename="gpushare API.json"'
    # A version names a schema of its own: generated for that request, never kept.
    client.get("/api/schema/?version=x" + "y" * 100)
    assert len(generated) == 2 and len(SchemaView._rendered) == 3
