"""Run the real platform processes against the test database, for e2e and browser tests.

Workers get the test database's URL and the test Redis, so what the test writes through
the ORM is what they see. Each run uses its own host name, hence its own agent queue.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.db import connection

from portal.launcher import AGENT_WORKER_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{Path(db['NAME']).resolve()}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str], every: float = 0.1
) -> Any:
    """``what`` may be a callable, called only on a timeout: logs read then say what happened
    while waiting (read before, they stop where the wait began)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")


class Platform:
    def __init__(
        self,
        var_dir: Path,
        log_dir: Path,
        heartbeat_s: int = 1,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``database_url``/``redis_url`` point the processes at other servers than the test
        database and Redis (fault tests restart their own); ``extra_env`` is added to each."""
        self.heartbeat_s = heartbeat_s
        self.database_url = database_url
        self.redis_url = redis_url
        self.extra_env = extra_env or {}
        self.host = f"e2e-{uuid.uuid4().hex[:6]}"
        self.var_dir = var_dir
        self.log_dir = log_dir
        var_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.port = 0
        self.enrolled = False
        self.credentials: dict[str, dict[str, str]] = {}  # host -> its agent's credential variables

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.database_url or database_url(),
            "REDIS_URL": self.redis_url or settings.REDIS_URL,
            "GPUSHARE_VAR_DIR": str(self.var_dir),
            "SECRET_KEY": settings.SECRET_KEY,
            "AGENT_HEARTBEAT_S": str(self.heartbeat_s),
            "CYCLE_INTERVAL_S": "1",
            "SANDBOX_STOP_GRACE_S": "2",
            **self.extra_env,
            **extra,
        }

    def start(self, name: str, argv: list[str], **extra: str) -> None:
        self.commands[name] = (argv, extra)
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env(**extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_workers(
        self,
        sim_gpus: str = "H100-80GB:2:mig=1",
        driver: str = "docker",
        celery_argv: list[str] | None = None,
    ) -> None:
        """``celery_argv`` replaces ``python -m celery`` (a wrapper that patches something first)."""
        celery = [*(celery_argv or [sys.executable, "-m", "celery"]), "-A", "workers"]
        self.start_control("control", celery)
        self.start(
            "agent",
            [
                *celery,
                "worker",
                "-Q",
                f"host.{self.host}",
                "-n",
                f"agent-{self.host}@%h",
                "-P",
                "threads",
                "-c",
                "2",
                *AGENT_WORKER_FLAGS,
                "--loglevel=INFO",
            ],
            **self.agent_credential(),
            GPUSHARE_ROLE="agent",
            GPUSHARE_HOST=self.host,
            GPUSHARE_SIM_GPUS=sim_gpus,
            GPU_BACKEND="simulated",
            SANDBOX_DRIVER=driver,
            SAMPLE_INTERVAL_MS=self.extra_env.get("SAMPLE_INTERVAL_MS", "500"),
        )
        self.start(
            "beat",
            [*celery, "beat", "-s", str(self.var_dir / "beat-schedule"), "--loglevel=INFO"],
            GPUSHARE_ROLE="beat",
        )

    def agent_credential(self, host: str | None = None) -> dict[str, str]:
        """An agent's credentials, as a deployed host has them (``manage.py host_credential``):
        its signing key and the control plane's public key always; its own Redis user where the
        test Redis is this suite's and has ACL selectors (Redis 7): the runs then show that an
        agent works within its ACL (``acl_denials``). Fault tests that restart their own Redis
        keep the control plane's URL (a restarted Redis has lost the users until the control
        worker's next start re-applies them)."""
        from portal.fleet import credentials
        from wire import broker_acl

        host = host or self.host
        if self.database_url is not None:  # enrolled in the platform's own database
            enrolled = subprocess.run(
                [sys.executable, "manage.py", "host_credential", "renew", host],
                cwd=ROOT, env=self.env(), capture_output=True, text=True, check=True,
            )  # fmt: skip
            env = dict(line.split("=", 1) for line in enrolled.stdout.splitlines() if "=" in line)
        else:
            env = credentials.renew(host).env()
        own_user = self.redis_url is None and self.database_url is None
        if not (own_user and broker_acl.supports_selectors(redis.Redis.from_url(settings.REDIS_URL))):
            del env["REDIS_URL"]
        elif host == self.host:
            self.enrolled = True
        self.credentials[host] = env
        return env

    def redis_log(self) -> list[dict[str, Any]]:
        """Redis's ACL LOG: what it refused, to whom, and why (``reason``: command, key,
        channel or auth)."""
        return redis.Redis.from_url(settings.REDIS_URL).acl_log(count=128)  # type: ignore[return-value]

    def acl_denials(self) -> list[str]:
        """What Redis refused this run's agent (its ACL LOG), one line each."""
        from wire import broker_acl

        log = self.redis_log()
        user = broker_acl.username(self.host)
        return [
            f"{e.get('reason')} {e.get('object')} ({e.get('context')})"
            for e in log
            if e.get("username") == user
        ]

    def start_control(self, name: str, celery: list[str] | None = None) -> None:
        """A control worker (queue ``control``) called ``name``; several may run at once."""
        celery = celery or [sys.executable, "-m", "celery", "-A", "workers"]
        self.start(
            name,
            # DEBUG: Celery's line per task, which INFO leaves out now; the fault tests count
            # the cycles each worker ran from them.
            [*celery, "worker", "-Q", "control", "-n", f"{name}-{self.host}@%h", "-P", "threads",
             "-c", "2", "--loglevel=DEBUG"],
            GPUSHARE_ROLE="control",
        )  # fmt: skip

    def start_web(
        self, tls: tuple[Path, Path] | None = None, name: str = "127.0.0.1", workers: int = 1
    ) -> str:
        """The ASGI server on loopback; over HTTPS with ``tls`` (certificate, key), its users
        reaching it as ``name`` (PORTAL_URL). Apps are served on their own origins, as make run
        serves them (Chromium resolves <sandbox>-<key>.apps.localhost to loopback by itself),
        unless the platform's environment names another APPS_DOMAIN. ``workers``: uvicorn's
        worker processes, as deploy/systemd/gpushare-web.service runs WEB_WORKERS of them."""
        self.port = free_port()
        scheme = "https" if tls else "http"
        defaults = {"PORTAL_URL": f"{scheme}://{name}:{self.port}", "APPS_DOMAIN": "apps.localhost"}
        env = {k: v for k, v in defaults.items() if k not in self.extra_env}
        self.start(
            "web",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "portal.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-proxy-headers",  # as every gpushare web server runs (portal/asgi.py)
                *(("--workers", str(workers)) if workers > 1 else ()),
                *(("--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])) if tls else ()),
            ],
            **env,
        )
        import ssl
        import urllib.request

        unverified = ssl._create_unverified_context()  # noqa: S323 - only asks whether it is up

        def up() -> bool:
            try:
                url = f"{scheme}://127.0.0.1:{self.port}/healthz"
                with urllib.request.urlopen(url, timeout=2, context=unverified) as r:  # noqa: S310
                    return r.status in (200, 503)
            except OSError as exc:
                return getattr(exc, "code", None) == 503

        wait_for(up, 30, "the web server")
        return f"{scheme}://127.0.0.1:{self.port}"

    def kill(self, name: str) -> None:
        """SIGKILL a process and its children, as a crash or the OOM killer would."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)

    def restart(self, name: str) -> None:
        argv, extra = self.commands[name]
        self.start(name, argv, **extra)

    def logs(self) -> str:
        """Each process's last lines, without DEBUG ones (the control worker's per-task pool
        lines would fill the tail)."""
        return "\n".join(
            f"--- {p.name} ---\n"
            + "\n".join(line for line in p.read_text(errors="replace").splitlines() if " DEBUG " not in line)[
                -4000:
            ]
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        """Stop the processes, then any sandbox this run's agent left behind (they outlive
        agents on purpose: containers, and process sandboxes under the var dir)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        from workers.drivers.docker import docker_available

        if docker_available():
            import docker

            client = docker.from_env()
            for container in client.containers.list(all=True, filters={"label": "io.gpushare.host"}):
                # This run's hosts: its own and those a test adds ("<host>-b"), unique per run.
                owner = container.labels.get("io.gpushare.host", "")
                if owner == self.host or owner.startswith(f"{self.host}-"):
                    container.remove(force=True)
        stop_process_sandboxes(self.var_dir)
        if self.enrolled:  # ACL users belong to the whole Redis server: leave none behind
            from wire import broker_acl

            redis.Redis.from_url(settings.REDIS_URL).execute_command(
                "ACL", "DELUSER", broker_acl.username(self.host)
            )


def stop_process_sandboxes(var_dir: Path) -> None:
    """Every process sandbox an agent made under ``var_dir`` (their state files say which)."""
    from workers.drivers.process import ProcessDriver

    for state_dir in var_dir.glob("agents/*/sandboxes"):
        driver = ProcessDriver(state_dir)
        for handle in driver.list_owned():
            driver.stop(handle, grace_s=0)


def _has_inventory(platform: Platform) -> bool:
    if platform.database_url is None:
        from portal.fleet.models import Host

        return Host.objects.filter(name=platform.host, gpus__isnull=False).exists()
    import psycopg  # another database than the test one: asked directly

    with psycopg.connect(platform.database_url, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT 1 FROM fleet_gpu g JOIN fleet_host h ON g.host_id = h.id WHERE h.name = %s LIMIT 1",
            (platform.host,),
        ).fetchone()
    return row is not None


@contextmanager
def running_platform(
    tmp_path: Path,
    web: bool = False,
    heartbeat_s: int = 1,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    extra_env: dict[str, str] | None = None,
    web_workers: int = 1,
    **workers: Any,
) -> Iterator[Platform]:
    (tmp_path / "logs").mkdir(exist_ok=True)
    platform = Platform(
        tmp_path / "var",
        tmp_path / "logs",
        heartbeat_s,
        database_url=database_url,
        redis_url=redis_url,
        extra_env=extra_env,
    )
    with stopped_after(platform):
        platform.start_workers(**workers)
        if web:
            platform.start_web(workers=web_workers)
        wait_for(lambda: _has_inventory(platform), 60, "the agent's inventory")
        yield platform


@contextmanager
def stopped_after(platform: Platform) -> Iterator[Platform]:
    """The platform's processes stopped at the end, their logs printed when it failed."""
    try:
        yield platform
    except BaseException:
        sys.stderr.write(platform.logs())
        raise
    finally:
        platform.stop()
        # Under Playwright's event loop Django keeps this context's connections apart from
        # the ones pytest-django closes; left open, they block dropping the test database.
        from django.db import connections

        connections.close_all()
