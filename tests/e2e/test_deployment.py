"""The production deployment (README "Deploying"), walked through as far as this machine allows.

- the systemd units under deploy/systemd/ pass ``systemd-analyze verify`` and start the
  processes the code expects (queue names, roles, credentials the settings read);
- deploy/nginx/gpushare.conf in front of the web unit's own command line, over real TLS:
  redirect, Secure cookies, static files, sign-in, a WebSocket, /healthz with a control
  worker started from its unit;
- backup and restore with pg_dump/pg_restore, the invoice triggers included;
- the upgrade step (the migrate unit's commands) from an older schema with data in it.

What needs systemd as PID 1, root or a GPU (starting the units themselves, the agent on
NVML) is not run here.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest
from django.db import connection

from tests.e2e.platform import ROOT, database_url, free_port, wait_for
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
HOST = "gpus.example.test"
ORIGIN = f"https://{HOST}"
APPS_DOMAIN = f"apps.{HOST}"
PROD_VENV, PROD_APP = "/opt/gpushare/venv", "/opt/gpushare/app"


def need(tool: str) -> str:
    path = shutil.which(tool) or (f"/usr/sbin/{tool}" if os.access(f"/usr/sbin/{tool}", os.X_OK) else None)
    require_engine(path is not None, tool)
    assert path is not None
    return path


def unit(name: str) -> dict[str, list[str]]:
    """A unit file's settings, key -> values in order (repeated keys such as ExecStart kept)."""
    settings: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def exec_start(name: str, index: int = 0) -> list[str]:
    return shlex.split(unit(name)["ExecStart"][index])


def unit_env(name: str) -> dict[str, str]:
    return dict(v.split("=", 1) for v in unit(name).get("Environment", []))


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def locally(argv: list[str], **subst: str) -> list[str]:
    """A unit's command line run here: this venv's python, specifiers and variables filled."""
    assert argv[0] == f"{PROD_VENV}/bin/python"
    out = [sys.executable]
    for arg in argv[1:]:
        for key, value in subst.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


# --- a. the units --------------------------------------------------------------------


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = need("systemd-analyze")
    # verify checks that every ExecStart binary exists: point the install paths at this
    # checkout and its virtualenv.
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "venv").symlink_to(ROOT / ".venv")
    files = sorted([*UNITS.glob("*.service"), *UNITS.glob("*.target")])
    assert {f.name for f in files} >= {
        "gpushare.target",
        "gpushare-migrate.service",
        "gpushare-web.service",
        "gpushare-control.service",
        "gpushare-beat.service",
        "gpushare-agent.service",
    }
    for f in files:
        text = f.read_text().replace(PROD_VENV, str(tmp_path / "opt" / "venv")).replace(PROD_APP, str(ROOT))
        (tmp_path / f.name).write_text(text)
    result = subprocess.run(
        [analyze, "verify", "--man=no", *(f.name for f in files)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert not re.search(r"unknown|error|not executable|failed", output, re.IGNORECASE), output


def test_unit_command_lines_match_the_code() -> None:
    from portal.settings import ASGI_APPLICATION
    from wire import config
    from wire.celery import CONTROL_QUEUE, ROLES, host_queue

    control, agent = exec_start("gpushare-control.service"), exec_start("gpushare-agent.service")
    for argv, role in ((control, "control"), (agent, "agent")):
        assert argv[1:6] == ["-m", "celery", "-A", "workers", "worker"]
        assert option(argv, "-P") == "threads"
        assert unit_env(f"gpushare-{role}.service")["GPUSHARE_ROLE"] == role and role in ROLES
    assert option(control, "-Q") == CONTROL_QUEUE
    # The agent serves the queue the control plane sends to for a host of its name.
    agent_env = unit_env("gpushare-agent.service")
    assert option(agent, "-Q") == host_queue(agent_env["GPUSHARE_HOST"]) == "host.%H"
    assert agent_env["GPU_BACKEND"] == "nvml" and agent_env["GPU_BACKEND"] in config.GPU_BACKENDS
    assert agent_env["SANDBOX_DRIVER"] == "docker" and agent_env["SANDBOX_DRIVER"] in config.SANDBOX_DRIVERS
    assert {"docker.service", "nvidia-persistenced.service"} <= set(
        " ".join(unit("gpushare-agent.service")["After"]).split()
    )

    beat = exec_start("gpushare-beat.service")
    assert beat[1:6] == ["-m", "celery", "-A", "workers", "beat"]
    assert unit_env("gpushare-beat.service")["GPUSHARE_ROLE"] == "beat"
    state_dir = unit("gpushare-beat.service")["StateDirectory"][0]
    assert option(beat, "-s").startswith(f"%S/{state_dir}/")

    web = exec_start("gpushare-web.service")
    assert web[1:4] == ["-m", "uvicorn", ASGI_APPLICATION.replace(".application", ":application")]
    # uvicorn believes no proxy itself: portal/asgi.py does, for TRUSTED_PROXIES only.
    assert "--no-proxy-headers" in web and option(web, "--host") == "127.0.0.1"
    assert unit_env("gpushare-web.service")["TRUSTED_PROXIES"] == "127.0.0.1"
    assert [a[1:] for a in map(shlex.split, unit("gpushare-migrate.service")["ExecStart"])] == [
        ["manage.py", "migrate", "--noinput"],
        ["manage.py", "collectstatic", "--noinput"],
    ]

    # Every credential is handed to the settings as NAME_FILE, for a NAME they read.
    settings_source = "".join(
        (ROOT / path).read_text()
        for path in ("portal/settings.py", "wire/config.py", "workers/host/agent_settings.py")
    )
    for name in ("migrate", "web", "control", "beat", "agent"):
        creds = {c.split(":", 1)[0] for c in unit(f"gpushare-{name}.service")["LoadCredential"]}
        files = {k: v for k, v in unit_env(f"gpushare-{name}.service").items() if k.endswith("_FILE")}
        assert {v.removeprefix("%d/") for v in files.values()} == creds, name
        for var in files:
            assert f'env_str("{var.removesuffix("_FILE")}"' in settings_source, var
        if name != "agent":
            assert unit(f"gpushare-{name}.service")["User"] == ["gpushare"]
            assert unit(f"gpushare-{name}.service")["ProtectSystem"] == ["strict"]
            assert name == "migrate" or unit(f"gpushare-{name}.service")["Restart"] == ["on-failure"]


def test_the_slurm_monitor_unit_runs_the_monitor_with_the_nodes_own_credential() -> None:
    argv = exec_start("gpushare-slurm-monitor.service")
    assert argv[1:] == ["-m", "workers.slurm.monitor"]
    assert importlib.util.find_spec("workers.slurm.monitor") is not None
    env = unit_env("gpushare-slurm-monitor.service")
    creds = {c.split(":", 1)[0] for c in unit("gpushare-slurm-monitor.service")["LoadCredential"]}
    assert creds == {"redis_url"} and env["REDIS_URL_FILE"] == "%d/redis_url"  # no control-plane secret
    source = (ROOT / "workers/slurm/monitor.py").read_text()
    for var in ("GPUSHARE_SLURM_NODE", "GPUSHARE_POOL_PREFIX", "GPUSHARE_HOST"):
        assert f'env_str("{var}"' in source, var
    assert unit("gpushare-slurm-monitor.service")["ProtectSystem"] == ["strict"]


# --- b. behind nginx, over TLS -------------------------------------------------------


def prod_env(tmp_path: Path, db_url: str, **extra: str) -> dict[str, str]:
    """The environment of a control-plane unit: DEBUG off, secrets from files."""
    secrets = tmp_path / "credentials"
    secrets.mkdir(exist_ok=True)
    from django.conf import settings

    for name, value in {
        "secret_key": "deploy-test-" + uuid.uuid4().hex + uuid.uuid4().hex,
        "database_url": db_url,
        "redis_url": settings.REDIS_URL,
    }.items():
        (secrets / name).write_text(value + "\n")
    dropped = {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "DEBUG", "ALLOWED_HOSTS", "STATIC_MANIFEST"}
    dropped |= {"SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {
        **env,
        "DEBUG": "false",
        "SECRET_KEY_FILE": str(secrets / "secret_key"),
        "DATABASE_URL_FILE": str(secrets / "database_url"),
        "REDIS_URL_FILE": str(secrets / "redis_url"),
        "ALLOWED_HOSTS": HOST,
        "CSRF_TRUSTED_ORIGINS": ORIGIN,
        "PORTAL_URL": ORIGIN,
        "APPS_DOMAIN": APPS_DOMAIN,
        "GPUSHARE_VAR_DIR": str(tmp_path / "var"),
        "DB_CONN_MAX_AGE": "0",  # the test database is dropped after the test
        **extra,
    }


@contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    except BaseException:
        sys.stderr.write(f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def render_nginx(tmp_path: Path, http_port: int, https_port: int, web_port: int) -> Path:
    """deploy/nginx/gpushare.conf with this test's ports and paths, in a minimal nginx.conf."""
    site = (DEPLOY / "nginx" / "gpushare.conf").read_text()
    for old, new in {
        "listen 80;": f"listen 127.0.0.1:{http_port};",
        "listen [::]:80;": "",
        "listen 443 ssl http2;": f"listen 127.0.0.1:{https_port} ssl http2;",
        "listen [::]:443 ssl http2;": "",
        "server 127.0.0.1:8000;": f"server 127.0.0.1:{web_port};",
        "server_name gpus.example.org;": f"server_name {HOST};",
        "server_name *.apps.gpus.example.org;": f"server_name *.{APPS_DOMAIN};",
        "/etc/ssl/gpushare/": f"{tmp_path}/tls/",
        "/var/lib/gpushare/staticfiles/": f"{tmp_path}/var/staticfiles/",
    }.items():
        assert old in site, old
        site = site.replace(old, new)
    ngx = tmp_path / "nginx"
    (ngx / "temp").mkdir(parents=True)
    (ngx / "gpushare.conf").write_text(site)
    temp = "".join(
        f"{kind}_temp_path {ngx}/temp/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = ngx / "nginx.conf"
    # Started as root, nginx's workers switch to nobody, who cannot enter pytest's 0700
    # tmp_path (in production www-data reads the 0755 StateDirectory): keep them as we are.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main.write_text(
        f"{user}pid {ngx}/nginx.pid;\nerror_log {ngx}/error.log info;\nworker_processes 1;\n"
        "events { worker_connections 64; }\n"
        f"http {{\ninclude /etc/nginx/mime.types;\naccess_log {ngx}/access.log;\n{temp}"
        f"include {ngx}/gpushare.conf;\n}}\n"
    )
    return main


class Proxy:
    """Requests to nginx on 127.0.0.1 as a browser would send them to https://gpus.example.test."""

    def __init__(self, https_port: int, cert: Path) -> None:
        self.port = https_port
        self.tls = ssl.create_default_context(cafile=str(cert))  # verifies the name, too
        self.cookies: dict[str, str] = {}

    def request(
        self,
        method: str,
        path: str,
        body: str | None = None,
        headers: dict[str, str] | None = None,
        host: str = HOST,
    ) -> tuple[http.client.HTTPResponse, bytes]:
        # Connect to our port, present the production host name (SNI and Host).
        conn = http.client.HTTPSConnection(host, self.port, context=self.tls, timeout=30)
        conn.sock = self.tls.wrap_socket(
            socket.create_connection(("127.0.0.1", self.port), timeout=30), server_hostname=host
        )
        sent = {"Host": host, **(headers or {})}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        for header in response.headers.get_all("Set-Cookie") or []:
            name, _, rest = header.partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        conn.close()
        return response, data


def set_cookie(response: http.client.HTTPResponse, name: str) -> str:
    return next(h for h in response.headers.get_all("Set-Cookie") or [] if h.startswith(f"{name}="))


class Stack:
    """nginx, the web unit and the control unit, started from their configuration and command
    lines; ``logs`` is what they said (attached to a failing step's report)."""

    def __init__(self, tmp_path: Path, http_port: int, proxy: Proxy, procs: dict[str, Any]) -> None:
        self.tmp_path, self.http_port, self.proxy, self.procs = tmp_path, http_port, proxy, procs

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}"
            for log in sorted(self.tmp_path.glob("*.log"))
        )


@pytest.fixture(scope="class")
def stack(scenario_db: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("proxy")
    nginx, openssl = need("nginx"), need("openssl")
    tls = tmp_path / "tls"
    tls.mkdir()
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", f"/CN={HOST}", "-addext", f"subjectAltName=DNS:{HOST},DNS:*.{APPS_DOMAIN}"),
            *("-keyout", str(tls / "privkey.pem"), "-out", str(tls / "fullchain.pem")),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    for name in ("fullchain.pem", "privkey.pem"):  # the apps' wildcard: here the same certificate
        shutil.copy(tls / name, tls / f"apps-{name}")
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_user("deploy-admin", password="deploy-test-password-1", is_staff=True)

    env = prod_env(tmp_path, database_url())
    # The migrate unit's second step, as the deploy runs it: hashed static files for nginx.
    subprocess.run(
        locally(exec_start("gpushare-migrate.service", 1)), cwd=ROOT, env=env, check=True, timeout=120
    )
    http_port, https_port, web_port = free_port(), free_port(), free_port()
    conf = render_nginx(tmp_path, http_port, https_port, web_port)
    subprocess.run([nginx, "-t", "-c", str(conf)], check=True, capture_output=True, timeout=30)
    web = locally(exec_start("gpushare-web.service"), **{"${WEB_WORKERS}": "1", "8000": str(web_port)})
    web_env = {**env, "TRUSTED_PROXIES": unit_env("gpushare-web.service")["TRUSTED_PROXIES"]}
    control = locally(exec_start("gpushare-control.service"), **{"%H": socket.gethostname(), "-c 4": "-c 1"})
    control[control.index("-n") + 1] = f"control-deploy-{uuid.uuid4().hex[:6]}@%h"
    with (
        process([nginx, "-c", str(conf), "-g", "daemon off;"], env, tmp_path / "nginx.log") as nginx_proc,
        process(web, web_env, tmp_path / "web.log") as web_proc,
        process(
            control,
            {**env, "GPUSHARE_ROLE": unit_env("gpushare-control.service")["GPUSHARE_ROLE"]},
            tmp_path / "control.log",
        ) as control_proc,
    ):
        procs = {"nginx": nginx_proc, "web": web_proc, "control": control_proc}
        yield Stack(tmp_path, http_port, Proxy(https_port, tls / "fullchain.pem"), procs)


@pytest.fixture(scope="class")
def state() -> dict[str, Any]:
    """What a step found that a later one uses."""
    return {}


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestThePortalBehindTheReverseProxy:
    def test_01_the_sign_in_page_answers_over_https_with_secure_cookies_and_hsts(
        self, stack: Stack, state: dict[str, Any]
    ) -> None:
        def login_page() -> Any:
            try:
                answer = stack.proxy.request("GET", "/login/")
            except OSError:  # nginx not listening yet
                return None
            return None if answer[0].status == 502 else answer  # uvicorn not yet

        response, body = wait_for(login_page, 60, "the portal through nginx", every=0.3)
        # X-Forwarded-Proto reached Django: it knows the request is https (no redirect
        # loop, Secure cookies, HSTS) although uvicorn itself speaks plain HTTP.
        assert response.status == 200, body[:500]
        # __Host- cookies: Secure, Path=/, no Domain, so no app origin can set one.
        csrf = set_cookie(response, "__Host-csrftoken")
        assert "; Secure" in csrf and "Path=/" in csrf and "Domain" not in csrf
        assert response.headers["Strict-Transport-Security"].startswith("max-age=")
        assert len(response.headers.get_all("X-Frame-Options") or []) == 1  # not doubled by nginx
        state["login_page"] = body

    def test_02_plain_http_is_redirected_to_https_by_nginx(self, stack: Stack) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
        conn.request("GET", "/login/?next=/", headers={"Host": HOST})
        redirect = conn.getresponse()
        assert redirect.status == 301
        assert redirect.headers["Location"] == f"https://{HOST}/login/?next=/"
        conn.close()

    def test_03_static_files_have_hashed_names_and_are_cached_for_a_year(
        self, stack: Stack, state: dict[str, Any]
    ) -> None:
        """They come from collectstatic's directory, through nginx."""
        login_page = state["login_page"]
        css = re.search(rb'/static/(dist/[^"]+\.js)', login_page)
        assert css, login_page[:2000]
        static, content = stack.proxy.request("GET", "/static/" + css.group(1).decode())
        assert static.status == 200 and content
        assert "immutable" in static.headers["Cache-Control"]
        assert "uvicorn" not in (static.headers.get("Server") or "")

    def test_04_signing_in_over_the_proxy_passes_csrf_and_gets_a_secure_session(
        self, stack: Stack, state: dict[str, Any]
    ) -> None:
        token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', state["login_page"])
        assert token
        form = f"csrfmiddlewaretoken={token.group(1).decode()}&username=deploy-admin&password=" + quote(
            "deploy-test-password-1"
        )
        signed_in, page = stack.proxy.request(
            "POST",
            "/login/",
            form,
            {
                "Content-Type": "application/x-www-form-urlencoded",
                "Origin": ORIGIN,
                "Referer": f"{ORIGIN}/login/",
            },
        )
        assert signed_in.status == 302, page[:1000]
        session = set_cookie(signed_in, "__Host-sessionid")
        assert "; Secure" in session and "Domain" not in session

    def test_05_a_websocket_through_nginxs_upgrade_is_accepted(self, stack: Stack) -> None:
        """With the session cookie and the site's Origin."""
        from websockets.sync.client import connect
        from websockets.typing import Origin

        raw = socket.create_connection(("127.0.0.1", stack.proxy.port), timeout=10)
        with (
            connect(
                f"wss://{HOST}/ws/fleet/",
                sock=raw,
                ssl=stack.proxy.tls,
                server_hostname=HOST,
                origin=Origin(ORIGIN),
                additional_headers={"Cookie": f"__Host-sessionid={stack.proxy.cookies['__Host-sessionid']}"},
                open_timeout=20,
            ) as ws,
            # Accepted, and not closed with 4403 (refused subscription) within a second.
            pytest.raises(TimeoutError),
        ):
            ws.recv(timeout=1)

    def test_06_healthz_turns_200_once_the_control_worker_beats(self, stack: Stack) -> None:
        """The control worker was started from its unit's command line."""

        def healthy() -> Any:
            answer, data = stack.proxy.request("GET", "/healthz")
            return json.loads(data) if answer.status == 200 else None

        checks = wait_for(healthy, 60, "/healthz 200 through nginx", every=1)["checks"]
        assert checks["database"]["ok"] and checks["redis"]["ok"] and checks["control_worker"]["ok"]

    def test_07_nginx_logged_the_websocket_upgrade(self, stack: Stack) -> None:
        access = (stack.tmp_path / "nginx" / "access.log").read_text()
        assert 'GET /ws/fleet/ HTTP/1.1" 101' in access, access

    def test_08_an_apps_origin_is_served_by_its_own_server_and_never_the_portal(self, stack: Stack) -> None:
        """The wildcard server (its certificate verified for the app's name) reaches the app
        proxy: with no app session a page load goes round the portal; the portal's sign-in
        page is not served there, with the portal's session cookie or without."""
        app_host = f"1-{'0' * 32}.{APPS_DOMAIN}"
        cookie = {"Cookie": f"__Host-sessionid={stack.proxy.cookies['__Host-sessionid']}"}
        answer, body = stack.proxy.request("GET", "/login/", headers=cookie, host=app_host)
        assert answer.status == 302, body[:500]
        assert answer.headers["Location"] == f"{ORIGIN}/sandboxes/1/app/login/"
        assert b"csrfmiddlewaretoken" not in body and answer.headers.get("Set-Cookie") is None


# --- c. backup and restore; d. upgrade ---------------------------------------------------


def pg_url(name: str) -> str:
    return re.sub(r"/[^/]*$", f"/{name}", database_url())


def pg_env() -> dict[str, str]:
    db = connection.settings_dict
    return {
        **os.environ,
        "PGHOST": db["HOST"] or "localhost",
        "PGPORT": str(db["PORT"] or 5432),
        "PGUSER": db["USER"],
        "PGPASSWORD": db.get("PASSWORD") or "",
    }


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """A new empty database beside the test database, dropped afterwards."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url("postgres"), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(pg_url("postgres"), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def row_counts(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
            ).fetchall()
        ]
        counts: dict[str, int] = {}
        for table in tables:  # names from pg_tables, quoted
            row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()  # noqa: S608
            assert row is not None
            counts[table] = row[0]
        return counts


def migrate_check(tmp_path: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "migrate", "--check"],
        cwd=ROOT,
        env=prod_env(tmp_path, url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def populate_billing(who: dict[str, Any], tiers: dict[str, Any]) -> None:
    """Sandboxes, closed usage and October's invoices of two projects, one finalized."""
    from portal.billing import ledger
    from portal.billing.invoices import do_draft_invoices, do_finalize
    from portal.billing.models import Invoice, UsageRecord
    from tests.portal.helpers import request

    for n, project in enumerate((who["project"], who["project"], who["other_project"])):
        owner = who["owner"] if project == who["project"] else who["outsider"]
        sandbox = request(owner, project, tiers["dedicated"], tiers["image"])
        UsageRecord.objects.create(
            sandbox=sandbox,
            allocation_key=f"deploy-{n}",
            project=project,
            user=owner,
            tier=sandbox.tier,
            gpu_model="H100-80GB",
            milli_gpu=1000,
            price_per_gpu_hour_micros=2_000_000,
            currency="EUR",
            started_at=datetime(2026, 10, 3, 9, tzinfo=UTC),
        )
        ledger.close_interval(
            SimpleNamespace(allocation_key=f"deploy-{n}"),  # type: ignore[arg-type]
            datetime(2026, 10, 3, 11 + n, tzinfo=UTC),
        )
    do_draft_invoices(date(2026, 10, 1), datetime(2026, 11, 5, tzinfo=UTC))
    do_finalize(Invoice.objects.get(project=who["project"]), who["admin"], datetime(2026, 11, 5, tzinfo=UTC))


# Production's database: the embedded pass (SQLite) has its own upgrade test below.
postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="a production deployment's PostgreSQL (pg_dump, upgrade)"
)


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_backup_and_restore(tmp_path: Path, people: Any, catalog: Any, sent_tasks: Any) -> None:
    pg_dump, pg_restore = need("pg_dump"), need("pg_restore")
    import psycopg

    populate_billing(people, catalog)
    source = database_url()
    dump = tmp_path / "gpushare.dump"
    # README "Backup": a custom-format dump, consistent without stopping anything.
    subprocess.run(
        [pg_dump, "-Fc", "--no-owner", "-f", str(dump), connection.settings_dict["NAME"]],
        env=pg_env(),
        check=True,
        timeout=120,
    )
    with scratch_database("gpushare_restore") as name:
        subprocess.run(
            [pg_restore, "--no-owner", "--exit-on-error", "-d", name, str(dump)],
            env=pg_env(),
            check=True,
            timeout=120,
        )
        restored = pg_url(name)
        before, after = row_counts(source), row_counts(restored)
        assert after == before
        assert after["billing_invoice"] == 2 and after["billing_usagerecord"] == 3
        assert after["sandboxes_sandbox"] == 3 and after["django_migrations"] > 0
        with psycopg.connect(restored) as conn:
            # The immutability triggers came back with the data.
            with pytest.raises(psycopg.errors.RaiseException, match="is finalized"):
                conn.execute("UPDATE billing_invoice SET total_micros = 0 WHERE state = 'finalized'")
            conn.rollback()
            assert conn.execute("SELECT count(*) FROM billing_invoice WHERE state = 'draft'").fetchone() == (
                1,
            )
        check = migrate_check(tmp_path, restored)
        assert check.returncode == 0, check.stdout + check.stderr


# The schema of the previous release: the newest migrations of some apps not yet applied
# (None: none of the app's).
OLD_RELEASE: dict[str, str | None] = {"quotas": "0002_fairshare_and_preemption"}
OLD_RELEASE |= {"billing": "0002_invoices_webhooks", "sandboxes": "0007_batch_runs"}
# portal.webhooks did not exist (its models were billing's); telemetry had no endpoint rows.
OLD_RELEASE |= {"telemetry": "0003_fault_alert_kinds", "webhooks": None}
# Run in a process of its own against the scratch database: migrate to OLD_RELEASE (the
# other apps to their newest) and write rows through the historical models of that state.
MIGRATE_TO_OLD_RELEASE = """
import json, sys, django
django.setup()
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
old = json.loads(sys.argv[1])
executor = MigrationExecutor(connection)
graph = executor.loader.graph
targets = [(app, old.get(app, name)) for app, name in graph.leaf_nodes()]
newer = [(app, name) for app, name in graph.leaf_nodes() if app in old]
plan = executor.migration_plan(targets)
planned = {(m.app_label, m.name) for m, _ in plan}
assert not planned & set(newer), planned & set(newer)
executor.migrate(targets)
apps = executor.loader.project_state([t for t in targets if t[1] is not None]).apps
Project = apps.get_model("accounts", "Project")
QuotaPolicy = apps.get_model("quotas", "QuotaPolicy")
User = apps.get_model("auth", "User")
Membership = apps.get_model("accounts", "Membership")
for slug, weight in (("vision", 2.0), ("nlp", 0.5)):
    project = Project.objects.create(name=slug.upper(), slug=slug)
    QuotaPolicy.objects.create(
        project=project, max_live_sandboxes=3, max_gpus=4, guaranteed_gpus=1, weight=weight
    )
user = User.objects.create(username="olivia", email="olivia@example.test")
Membership.objects.create(user=user, project=Project.objects.get(slug="vision"), role="manager")
print(sorted(planned))
"""


def migrate_to_old_release(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-c", MIGRATE_TO_OLD_RELEASE, json.dumps(OLD_RELEASE)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=180,
    )


def test_make_run_upgrades_the_embedded_database_of_the_previous_release(tmp_path: Path) -> None:
    """`git pull && make run` on a laptop: the launcher's migrate brings the SQLite file of
    the previous release up to date, its rows intact (SQLite has its own trigger migrations)."""
    sqlite_file = tmp_path / "gpushare.sqlite3"
    url = f"sqlite:///{sqlite_file}"
    env = prod_env(tmp_path, url)
    migrate_to_old_release(env)
    assert migrate_check(tmp_path, url).returncode != 0  # migrations to apply
    upgrade = subprocess.run(  # what portal/launcher.py runs first
        [sys.executable, "manage.py", "migrate", "--noinput"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=180,
    )  # fmt: skip
    for app, old in OLD_RELEASE.items():
        assert f"Applying {app}." in upgrade.stdout and f"Applying {app}.{old}" not in upgrade.stdout
    import sqlite3

    with contextlib.closing(sqlite3.connect(sqlite_file)) as conn:
        rows = conn.execute(
            "SELECT p.slug, q.weight, q.max_gpu_hours_month FROM quotas_quotapolicy q "
            "JOIN accounts_project p ON p.id = q.project_id ORDER BY p.slug"
        ).fetchall()
    assert rows == [("nlp", 0.5, None), ("vision", 2.0, None)]
    check = migrate_check(tmp_path, url)
    assert check.returncode == 0, check.stdout + check.stderr


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_upgrade_from_the_previous_release(tmp_path: Path) -> None:
    import psycopg

    with scratch_database("gpushare_upgrade") as name:
        url = pg_url(name)
        env = prod_env(tmp_path, url)
        migrate_to_old_release(env)
        pending = migrate_check(tmp_path, url)
        assert pending.returncode != 0  # the old release's schema: migrations to apply
        # The upgrade step: the migrate unit's first command, as `systemctl start` runs it.
        upgrade = subprocess.run(
            locally(exec_start("gpushare-migrate.service", 0)),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=180,
        )
        for app, old in OLD_RELEASE.items():
            assert f"Applying {app}." in upgrade.stdout and f"Applying {app}.{old}" not in upgrade.stdout
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT p.slug, q.weight, q.max_gpu_hours_month FROM quotas_quotapolicy q "
                "JOIN accounts_project p ON p.id = q.project_id ORDER BY p.slug"
            ).fetchall()
            assert rows == [("nlp", 0.5, None), ("vision", 2.0, None)]
            assert conn.execute(
                "SELECT u.username, m.role FROM accounts_membership m JOIN auth_user u ON u.id = m.user_id"
            ).fetchall() == [("olivia", "manager")]
        check = migrate_check(tmp_path, url)
        assert check.returncode == 0, check.stdout + check.stderr
