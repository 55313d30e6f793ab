"""Security rules, each from the outsider's side: what a browser, a proxy, a password
guesser, a foreign page or a raw SQL session sees (README "Security")."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.db import DatabaseError, connection, transaction
from django.test import Client, override_settings

from portal.audit.models import AuditEntry
from tests.portal.helpers import client_for
from wire.env import ConfigError, env_str

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery staple"
# The test process runs with DEBUG off but plain-HTTP conveniences (tests/testenv.py);
# these put production's HTTPS behaviour back for the header checks.
HTTPS = {"SECURE_SSL_REDIRECT": True, "SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True}
# What the test environment sets that production would not.
TEST_ONLY = ("SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT", "STATIC_MANIFEST")


@pytest.fixture(autouse=True)
def fast_hashing(settings: Any) -> None:
    """Logins here are many and the password hasher's cost is not what is tested."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _production_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TEST_ONLY and not k.startswith("SECRET_KEY")}
    env.update(DEBUG="false", ALLOWED_HOSTS="gpus.example.org", SECRET_KEY=secrets.token_urlsafe(50))
    env.update(extra)
    return {k: v for k, v in env.items() if v != ""}


def _manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


# --- Production settings -------------------------------------------------------------------


def test_production_settings_pass_the_deploy_check() -> None:
    # manage.py check --deploy --fail-level WARNING is call_command("check", deploy=True,
    # fail_level="WARNING") in a process whose settings come from production's environment.
    result = _manage(_production_env(), "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize(
    "key",
    ["short-key", "a" * 60, "django-insecure-" + secrets.token_urlsafe(50)],
    ids=["short", "one-character", "django-insecure"],
)
def test_production_refuses_a_weak_secret_key(key: str) -> None:
    result = _manage(_production_env(SECRET_KEY=key), "check")
    assert result.returncode == 2
    assert "SECRET_KEY must be at least 50 random characters" in result.stderr


# --- Secrets from files --------------------------------------------------------------------


def test_every_secret_may_come_from_a_file(tmp_path: Path) -> None:
    values = {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DATABASE_URL": "postgres://gpushare:pw@db.example:5432/gpushare",
        "REDIS_URL": "redis://redis.example:6379/3",
        "METRICS_TOKEN": "metrics-" + secrets.token_hex(8),
        "ALERT_WEBHOOK_SECRET": "hook-" + secrets.token_hex(8),
    }
    files = {}
    for name, value in values.items():
        (tmp_path / name).write_text(f"{value}\n")  # as `echo value > file` leaves it
        files[f"{name}_FILE"] = str(tmp_path / name)
    env = _production_env(**{name: "" for name in values}, **files)
    script = (
        "from django.conf import settings as s; db = s.DATABASES['default']; print(s.SECRET_KEY, "
        "db['HOST'], db['PASSWORD'], s.REDIS_URL, s.METRICS_TOKEN, s.ALERT_WEBHOOK_SECRET)"
    )
    result = _manage(env, "shell", "--no-imports", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        values["SECRET_KEY"],
        "db.example",
        "pw",
        values["REDIS_URL"],
        values["METRICS_TOKEN"],
        values["ALERT_WEBHOOK_SECRET"],
    ]


def test_a_secret_and_its_file_together_stop_startup(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file")
    env = _production_env(METRICS_TOKEN="from-env", METRICS_TOKEN_FILE=str(tmp_path / "token"))
    result = _manage(env, "check")
    assert result.returncode == 2
    assert "METRICS_TOKEN and METRICS_TOKEN_FILE are both set: set one of them" in result.stderr


def test_an_empty_secret_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("X_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"X_TOKEN_FILE: .* is empty"):
        env_str("X_TOKEN", "")


# --- HTTPS, cookies and headers ------------------------------------------------------------


@pytest.mark.django_db
def test_plain_http_is_redirected_to_https_except_probes() -> None:
    with override_settings(**HTTPS):
        response = Client().get("/login/")
        assert response.status_code == 301 and response["Location"] == "https://testserver/login/"
        # Over https (behind the TLS proxy, portal.asgi makes it the request's scheme) nothing
        # is redirected; an X-Forwarded-Proto from the client itself changes nothing.
        assert Client().get("/login/", secure=True).status_code == 200
        assert Client().get("/login/", headers={"X-Forwarded-Proto": "https"}).status_code == 301
        # Load-balancer probes and Prometheus scrape over plain HTTP inside the network.
        assert Client().get("/healthz").status_code in (200, 503)
        assert Client().get("/metrics").status_code in (401, 403)


@pytest.mark.django_db
def test_https_responses_carry_hsts_csp_and_secure_cookies(people: Any) -> None:
    people["outsider"].set_password(PASSWORD)
    people["outsider"].save()
    client = Client()
    with override_settings(**HTTPS):
        page = client.get("/login/", secure=True)
        assert page.status_code == 200
        assert page["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
        assert page["X-Frame-Options"] == "DENY"
        assert page["X-Content-Type-Options"] == "nosniff"
        assert page["Referrer-Policy"] == "same-origin"
        assert page["Cross-Origin-Opener-Policy"] == "same-origin"
        policy = csp_directives(page)
        assert policy["default-src"] == "'self'"
        assert policy["script-src"] == "'self'"  # no 'unsafe-inline', no 'unsafe-eval'
        assert policy["style-src"] == "'self' 'unsafe-inline'"
        assert policy["connect-src"] == "'self' wss://testserver"
        assert policy["object-src"] == policy["frame-ancestors"] == "'none'"
        assert policy["base-uri"] == policy["form-action"] == "'self'"
        assert page.cookies["csrftoken"]["secure"]
        signed_in = client.post("/login/", {"username": "oscar", "password": PASSWORD}, secure=True)
        assert signed_in.status_code == 302
        session = signed_in.cookies["sessionid"]
        assert session["secure"] and session["httponly"] and session["samesite"] == "Lax"


def csp_directives(response: Any) -> dict[str, str]:
    """The Content-Security-Policy header as {directive: sources}: its order is not fixed."""
    parts = (d.strip().split(" ", 1) for d in response["Content-Security-Policy"].split(";") if d.strip())
    return {name: sources for name, sources in parts}


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.IGNORECASE)
INLINE_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.IGNORECASE)


def test_templates_have_no_inline_scripts_or_event_handlers() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {pattern.pattern}"
        for path in (ROOT / "templates").rglob("*.html")
        for pattern in (INLINE_SCRIPT, INLINE_HANDLER)
        if pattern.search(path.read_text())
    ]
    assert offenders == []


@pytest.mark.django_db
def test_swagger_ui_loads_under_the_policy(people: Any) -> None:
    client = client_for(people["outsider"])
    page = client.get("/api/docs/")
    assert page.status_code == 200 and csp_directives(page)["script-src"] == "'self'"
    html = page.content.decode()
    assert not INLINE_SCRIPT.search(html)
    script_url = re.findall(r'<script src="([^"]+)"', html)[-1].replace("&amp;", "&")
    script = client.get(script_url)
    assert script.status_code == 200 and script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()
    for asset in re.findall(r'(?:src|href)="(/static/[^"?]+)"', html):
        assert client.get(asset).status_code == 200, asset


# --- WebSocket origin ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the consumer reads the session in its own thread
def test_websockets_accept_only_the_sites_own_origin(people: Any) -> None:
    """Compared by scheme, host and port, like Django's CSRF origin check: the outside probe
    (finding 8) was let in from any port or scheme of an allowed host."""
    from portal.asgi import application

    cookie = f"sessionid={client_for(people['admin']).cookies['sessionid'].value}".encode()

    async def connects(origin: bytes | None, host: bytes = b"localhost:8000", scheme: str = "ws") -> bool:
        headers = [(b"host", host), (b"cookie", cookie), *([(b"origin", origin)] if origin else [])]
        comm = WebsocketCommunicator(application, "/ws/fleet/", headers=headers)
        comm.scope["scheme"] = scheme
        connected, _ = await comm.connect()
        await comm.disconnect()
        return connected

    async def run() -> list[bool]:
        return [
            await connects(b"http://localhost:8000"),  # the page's own origin
            await connects(b"HTTP://LOCALHOST:8000"),  # the same, spelled otherwise
            await connects(b"http://localhost:8001"),  # another port of the same host
            await connects(b"https://localhost:8000"),  # another scheme
            await connects(b"http://localhost"),  # port 80, not 8000
            await connects(b"http://evil.example:8000"),
            await connects(b"http://localhost.evil.example:8000"),
            await connects(b"null"),
            await connects(None),
            await connects(b"http://evil.example", host=b"evil.example"),  # not an allowed host
            await connects(b"https://localhost", host=b"localhost", scheme="wss"),  # behind TLS
        ]

    assert asyncio.run(run()) == [True, True, False, False, False, False, False, False, False, False, True]


# --- The audit log -------------------------------------------------------------------------


@pytest.fixture
def entry(people: Any) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=people["admin"], actor_name="ada", action="drained", target_type="fleet.gpu", target_id="1"
    )


@pytest.mark.django_db
def test_the_orm_cannot_edit_the_audit_log(entry: AuditEntry) -> None:
    entry.message = "nothing happened"
    with pytest.raises(PermissionError, match="append-only"):
        entry.save()
    with pytest.raises(PermissionError, match="append-only"):
        entry.delete()
    with pytest.raises(PermissionError, match="append-only"):
        AuditEntry.objects.filter(pk=entry.pk).update(message="rewritten")
    with pytest.raises(PermissionError, match="append-only"):
        AuditEntry.objects.all().delete()
    assert AuditEntry.objects.get().message == ""


@pytest.mark.django_db
def test_raw_sql_cannot_edit_the_audit_log(entry: AuditEntry) -> None:
    statements = ["UPDATE console_auditentry SET message = 'rewritten'"]
    if connection.vendor == "postgresql":  # SQLite's trigger refuses UPDATE only (see the migration)
        statements.append("DELETE FROM console_auditentry")
    for sql in statements:
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as c,
        ):
            c.execute(sql)
    assert AuditEntry.objects.get().message == ""


@pytest.mark.django_db
def test_the_admin_shows_the_audit_log_read_only_even_to_superusers(people: Any, entry: AuditEntry) -> None:
    admin = client_for(people["admin"])
    base = "/admin/audit/auditentry/"
    listing = admin.get(base)
    assert listing.status_code == 200 and "Add audit entry" not in listing.content.decode()
    detail = admin.get(f"{base}{entry.pk}/change/")
    assert detail.status_code == 200 and 'name="_save"' not in detail.content.decode()
    assert admin.post(f"{base}{entry.pk}/change/", {"message": "rewritten"}).status_code == 403
    assert admin.get(f"{base}add/").status_code == 403
    assert admin.post(f"{base}{entry.pk}/delete/", {"post": "yes"}).status_code == 403
    bulk = admin.post(base, {"action": "delete_selected", "_selected_action": [entry.pk], "post": "yes"})
    assert bulk.status_code in (200, 302) and AuditEntry.objects.filter(pk=entry.pk).exists()
    assert AuditEntry.objects.get().message == ""


# --- Ruff's security rules -----------------------------------------------------------------


def test_ruff_security_rules_pass_without_blanket_suppressions() -> None:
    # S: flake8-bandit; PGH004: every suppression comment must name the rules it silences.
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run(
        [str(ruff), "check", "--no-cache", "--select", "S,PGH004", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
