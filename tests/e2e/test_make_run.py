"""`make run` as a newcomer runs it: the launcher on the embedded defaults (SQLite, the
embedded Redis, simulated GPUs, the process driver), not the test database.

One platform for the module, then steps that each name what failed: it comes up with both
agents self-tested, a sandbox of every sharing mode reaches running and the terminal shows
one line per transition and no per-task chatter, and Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.demo import DEMO_HOSTS
from tests.e2e.make_run import Launcher
from tests.e2e.platform import stop_process_sandboxes, wait_for
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


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    base = tmp_path_factory.mktemp("make-run")
    running = Launcher(base / "var", base / "make-run.log")
    running.start()
    yield running
    running.kill()
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
    # Each agent is connected as its host's own Redis user, as a deployed GPU host is (issue 38).
    users = launcher.manage(
        "import redis; from wire import config; c = redis.Redis.from_url(config.redis_url()); "
        "print(' '.join(sorted({x['user'] for x in c.client_list()})))"
    )
    assert {f"gpushare-host-{name}" for name in DEMO_HOSTS} <= set(users.split()), users


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
