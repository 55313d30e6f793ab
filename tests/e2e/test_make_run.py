"""`make run` as a newcomer runs it: the launcher on the embedded defaults (SQLite, the
embedded Redis, simulated GPUs, the process driver), not the test database.

One platform for the module, then steps that each name what failed: it comes up with both
agents self-tested, a sandbox of every sharing mode reaches running and the terminal shows
one line per transition and no per-task chatter, and Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.platform import free_port, stop_process_sandboxes, wait_for
from tests.workers.engines import require_engine
from workers.drivers.process import bwrap_available

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.slow, pytest.mark.steps]
ROOT = Path(__file__).resolve().parents[2]
MODES: dict[str, dict[str, Any]] = {
    "dedicated": {"gpu_count": 1},
    "mig": {"mig_profile": "1g.10gb"},
    "mps": {"mps_memory_gib": 8, "mps_thread_pct": 25},
    "timeslice": {},
    "cpu": {},  # the demo's CPU-only tier: no GPU field at all
}


class Launcher:
    def __init__(self, var_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.env = {
            key: value
            for key, value in os.environ.items()
            # The newcomer's environment: none of the test run's servers or settings.
            if key not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS", "DEBUG", "LOG_LEVEL"}
            and not key.startswith(("SECURE_", "SESSION_", "CSRF_", "STATIC_"))
        }
        self.env |= {"GPUSHARE_VAR_DIR": str(var_dir), "PORT": str(self.port), "SANDBOX_DRIVER": "process"}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "portal.launcher"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def healthz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as answer:
                return dict(json.loads(answer.read()))
        except OSError:
            return None

    def manage(self, code: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=ROOT, env={**self.env, "DEBUG": "true"}, capture_output=True, text=True, timeout=60,
            check=True,
        )  # fmt: skip
        return done.stdout.strip()

    def post(self, path: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
            return answer.status, dict(json.loads(answer.read()))

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's group
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    base = tmp_path_factory.mktemp("make-run")
    running = Launcher(base / "var", base / "make-run.log")
    running.start()
    yield running
    if running.proc is not None and running.proc.poll() is None:
        os.killpg(running.proc.pid, signal.SIGKILL)
        running.proc.wait()
    stop_process_sandboxes(base / "var")  # they outlive make run, as they outlive agents


def test_it_comes_up_with_both_agents_self_tested(launcher: Launcher) -> None:
    def both_agents_up() -> dict[str, Any] | None:
        health = launcher.healthz()  # None until it answers 200
        agents = (health or {}).get("checks", {}).get("agents", {})
        return health if len(agents) == 2 and all(a["ok"] for a in agents.values()) else None

    health = wait_for(both_agents_up, 180, "/healthz to answer 200 with both demo agents up", every=1)
    assert health is not None and health["ok"]
    text = launcher.output()
    assert text.count("agent started; sandbox driver process: a test sandbox launched and stopped") == 2, text


def test_a_sandbox_of_every_sharing_mode_reaches_running(launcher: Launcher) -> None:
    key = launcher.manage(
        "from django.contrib.auth.models import User; from portal.accounts.models import ApiToken; "
        "print(ApiToken.issue(User.objects.get(username='alice'), 'make-run', ['write:sandboxes'])[1])"
    ).splitlines()[-1]
    ids = []
    for tier, fields in MODES.items():
        body = {"project": "vision-lab", "tier": tier, "image": "busybox", "isolation": "process",
                "duration_hours": 1, **fields}  # fmt: skip
        status, answer = launcher.post("/api/v1/sandboxes/", key, body)
        assert status == 201, answer
        ids.append(answer["id"])

    def ran(pk: int) -> bool:
        return f"sandbox {pk}: starting → running" in launcher.output()

    for pk in ids:
        wait_for(lambda pk=pk: ran(pk), 120, f"sandbox {pk} to run; the terminal shows:\n"  # type: ignore[misc]
                 f"{launcher.output()[-3000:]}", every=0.5)  # fmt: skip


def test_the_control_worker_mails_the_starts_through_the_console_backend(launcher: Launcher) -> None:
    """No EMAIL_HOST here: the notification mails alice gets by default (a start) are
    written to the control worker's output, which is make run's terminal."""
    wait_for(
        lambda: "Subject: [gpushare] Started: Sandbox" in launcher.output(), 60,
        lambda: f"a start's mail in the terminal:\n{launcher.output()[-3000:]}", every=0.5,
    )  # fmt: skip
    assert "To: alice@example.org" in launcher.output()


def test_apps_have_origins_of_their_own_under_apps_localhost_with_no_dns_set_up(launcher: Launcher) -> None:
    """A browser resolves <sandbox>-<key>.apps.localhost to loopback itself: the launcher's
    server sends such a Host to the app proxy (no app session here: round the portal), and
    never serves the portal's own pages there."""
    host = f"1-{'0' * 32}.apps.localhost:{launcher.port}"
    request = urllib.request.Request(f"http://127.0.0.1:{launcher.port}/login/", headers={"Host": host})

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None

    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.build_opener(NoRedirect).open(request, timeout=10)
    assert answer.value.code == 302
    assert answer.value.headers["Location"] == f"http://localhost:{launcher.port}/sandboxes/1/app/login/"


def test_the_terminal_shows_transitions_not_per_task_chatter(launcher: Launcher) -> None:
    text = launcher.output()
    assert re.search(r"sandbox \d+: requested → queued", text), text[-3000:]
    assert "Task workers." not in text, "Celery's per-task lines leak into the terminal"
    assert "celery@" not in text and "[tasks]" not in text, "a Celery start-up banner"
    assert "Traceback" not in text, text[-3000:]


def test_ctrl_c_stops_everything_cleanly(launcher: Launcher) -> None:
    started = time.monotonic()
    assert launcher.stop() == 0, launcher.output()[-3000:]
    assert "gpushare: stopped." in launcher.output()
    assert time.monotonic() - started < 60
