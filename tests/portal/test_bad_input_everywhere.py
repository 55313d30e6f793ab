"""Bad input on every route: each URL of the URLconf gets hostile query parameters, and each
HTML form hostile fields, from a signed-in member and from an admin; none may answer 5xx.

Routes are enumerated from the URLconf itself (only Django admin's own pages are left to
Django), so a new page or endpoint is fuzzed the day it is added: ``test_every_route_is_
covered`` fails if one has no concrete path below. The outside probe's 500s (finding 3) came
from values like these: Unicode digits, forged cursors, out-of-range numbers.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import seed_host
from tests.portal.helpers import place_all, request

pytestmark = pytest.mark.django_db
EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _cursor(query: str) -> str:
    return base64.b64encode(query.encode()).decode()


VALUES = [
    "", " ", "0", "-1", "1", "99", "9" * 40, "1e9", "1.5", "NaN", "inf", "²", "٣", "¹²", "\uff10",
    "' OR 1=1 --", "<script>alert(1)</script>", "../../etc/passwd", "%00", "a\x00b", "\x1b[31m",
    "line\nbreak", "\u202egnp.exe", "x" * 5000, "{{7*7}}", "2026-13-45", "2026-02-30T25:61:00+99:00",
    "GPU-00000000-0000-0000-0000-000000000000", "MIG-../../x", "vision", "dedicated", "tier",
    _cursor("o=0&r=0&p=yesterday"), _cursor("o=-5&r=2&p=1"), _cursor("p=" + "9" * 30), "!!notbase64",
]  # fmt: skip
PARAMETERS = [
    "minutes", "sandbox", "gpu", "metric", "cursor", "page_size", "project", "user", "tier", "start",
    "end", "period", "state", "by", "target", "next", "format", "q", "privileged", "page",
]  # fmt: skip
FORM_FIELDS = [
    "project", "tier", "image", "isolation", "gpu_count", "mig_profile", "mps_memory_gib",
    "mps_thread_pct", "duration_hours", "run", "command", "hours", "action", "role", "username",
    "membership", "reason", "host", "gpu", "profile", "target", "fingerprint", "plan", "name", "slug",
    "price_per_gpu_hour", "sharing_mode", "max_gpus", "password", "next", "privileged", "scopes",
    "expiry_days", "old_password", "new_password1", "new_password2", "email", "public_key",
]  # fmt: skip
# URL kwargs of the URLconf -> a value that exists in the world below (or a plausible one).
KWARGS = {
    "pk": "{sandbox}", "slug": "vision", "uuid": "{gpu}", "kind": "tier",
    "uidb64": "MQ", "token": "set-password",  # a reset link's parts (Django's own view)
    "path": "lab/tree",  # a path under a sandbox's app (the grant's next page)
    "host": "gpu-nul-probe",  # a host to enrol, rotate or revoke
}  # fmt: skip
POSTED = {
    "sandbox-new", "sandbox-preview", "project-members", "sandbox-stop", "sandbox-extend",
    "console-catalog-new", "console-catalog-edit", "console-start-mig-relayout",
    "console-start-consolidation", "console-drain-gpu", "console-undrain-gpu", "console-plans",
    "login", "logout", "api-tokens", "api-token-revoke", "password_change", "password_reset",
    "password_reset_confirm", "console-hosts-issue", "console-hosts-rotate", "console-hosts-revoke",
    "ssh-keys", "ssh-key-remove",
}  # fmt: skip


def _routes() -> list[tuple[str, str]]:
    """(name, route) of every URL outside Django admin, format-suffix variants left out."""
    found: list[tuple[str, str]] = []

    def walk(patterns: Any, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                if not route.startswith("admin/"):
                    walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern) and "format" not in route:
                found.append((pattern.name or route, route))

    walk(get_resolver().url_patterns, "")
    return found


def concrete(route: str, world: dict[str, Any]) -> str:
    """A path for ``route``: its converters and regex groups filled from KWARGS."""

    def fill(match: re.Match[str]) -> str:
        return KWARGS[match.group("name")].format(**world)

    path = re.sub(r"\(\?P<(?P<name>\w+)>[^)]*\)", fill, route)  # DRF's regex routes first
    path = re.sub(r"<(?:\w+:)?(?P<name>\w+)>", fill, path)
    return "/" + path.replace("^", "").replace("$", "")


@pytest.fixture
def world(people: Any, catalog: Any, sent_tasks: Any, settings: Any) -> dict[str, Any]:
    cache.clear()
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"burst": "1000000/min", "sustained": "1000000/hour"},
    }
    seed_host("fuzz", "H100-80GB:2:mig=1")
    mine = request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    gpu = mine.allocations.get().gpu.uuid
    member, admin = Client(), Client()
    member.force_login(people["member"])
    admin.force_login(people["admin"])
    return {"sandbox": mine.pk, "gpu": gpu, "member": member, "admin": admin}


def _no_failure(path: str, response: Any) -> bool:
    # /healthz answers 503 while no control worker beats (none runs here): its meaning.
    return response.status_code < 500 or (path == "/healthz" and response.status_code == 503)


def _two_values(*key: str) -> list[str]:
    """Unicode digits everywhere, and one more value per place, rotating through VALUES."""
    return ["²", VALUES[sum(map(ord, "".join(key))) % len(VALUES)]]


@pytest.mark.slow  # ~22 s on 2 cores: make test runs it, make test-fast leaves it out
def test_every_parameter_of_every_route(world: dict[str, Any]) -> None:
    """Each route, each parameter alone (an API refuses an unknown one before reading the
    rest), as a member and as an admin."""
    for _name, route in _routes():
        path = concrete(route, world)
        for who in ("member", "admin"):
            for name in PARAMETERS:
                for value in _two_values(route, name, who):
                    response = world[who].get(path, {name: value})
                    assert _no_failure(path, response), (who, path, name, value, response.content[:300])


def test_a_nul_byte_in_any_parameter_of_any_route(world: dict[str, Any]) -> None:
    """PostgreSQL refuses NUL in text outright: every parameter a view compares with a text
    column must be refused first (``portal.inputs.plain_text``). Once, deterministically, as the
    examples above reach it only by chance (the alerts' ``gpu`` and the audit log's ``target``
    once slipped through)."""
    for _name, route in _routes():
        path = concrete(route, world)
        for name in PARAMETERS:
            response = world["admin"].get(path, {name: "a\x00b"})
            assert _no_failure(path, response), (path, name, response.content[:300])


def test_every_field_of_every_form(world: dict[str, Any]) -> None:
    for name, route in _routes():
        if name not in POSTED or name == "logout":
            continue
        path = concrete(route, world)
        for field in FORM_FIELDS:
            for value in _two_values(route, field):
                response = world["admin" if route.startswith("console/") else "member"].post(
                    path, {field: value}
                )
                assert response.status_code < 500, (path, field, value, response.content[:300])


def test_every_route_is_covered(world: dict[str, Any]) -> None:
    for _name, route in _routes():
        path = concrete(route, world)
        assert "<" not in path and "(?P" not in path, f"no value for a parameter of {route}"


@EXAMPLES
@given(
    route=st.sampled_from(_routes()),
    params=st.dictionaries(st.sampled_from(PARAMETERS), st.sampled_from(VALUES), max_size=3),
    who=st.sampled_from(["member", "admin"]),
)
def test_no_query_string_makes_a_page_or_endpoint_fail(
    world: dict[str, Any], route: tuple[str, str], params: dict[str, str], who: str
) -> None:
    path = concrete(route[1], world)
    response = world[who].get(path, params)
    assert _no_failure(path, response), (path, params, response.status_code, response.content[:300])


@EXAMPLES
@given(
    route=st.sampled_from([r for r in _routes() if r[0] in POSTED]),
    fields=st.dictionaries(st.sampled_from(FORM_FIELDS), st.sampled_from(VALUES), max_size=6),
    repeated=st.none() | st.sampled_from(FORM_FIELDS),
    who=st.sampled_from(["member", "admin"]),
)
def test_no_form_body_makes_a_page_fail(
    world: dict[str, Any], route: tuple[str, str], fields: dict[str, str], repeated: str | None, who: str
) -> None:
    path = concrete(route[1], world)
    body: dict[str, Any] = dict(fields)
    if repeated:  # a field given twice
        body[repeated] = [fields.get(repeated, "1"), "2"]
    response = world[who].post(path, body, headers={"HX-Request": "true"} if "preview" in path else {})
    assert response.status_code < 500, (path, body, response.status_code, response.content[:300])
