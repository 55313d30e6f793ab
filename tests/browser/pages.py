"""What the browser tests share: Chromium's flags, axe-core, screenshots for the docs,
signing in. The ``browser_page`` fixture is in conftest.py."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from tests.workers.engines import require_engine
from wire.config import var_dir

CHROMIUM = "/usr/bin/chromium"
# Under the run's var dir (git-ignored), so a test run leaves the tree as it found it; `make
# screenshots` sets GPUSHARE_SCREENSHOTS=docs/screenshots to renew the ones the docs show.
SHOTS = Path(os.environ.get("GPUSHARE_SCREENSHOTS") or var_dir() / "screenshots").resolve()
# Flags that keep headless Chromium from reaching for the network on a closed machine.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def accept_dialog(dialog: Any) -> None:
    dialog.accept()  # the pages' confirm() prompts (stop, drain)


AXE = Path(__file__).resolve().parents[2] / "node_modules" / "axe-core" / "axe.min.js"
AXE_PATH = "/__browser-tests__/axe.min.js"


def wait_until(page: Any, expression: str, timeout: float = 30_000) -> None:
    """``page.wait_for_function`` without its ``eval``, which the pages' CSP forbids
    (no 'unsafe-eval'): ``page.evaluate`` runs through DevTools, outside the policy."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout / 1000:.0f} s: {expression}")
        page.wait_for_timeout(100)


def accessibility_problems(page: Any) -> list[str]:
    """axe-core's serious and critical violations on the page as it is now."""
    require_engine(AXE.exists(), f"axe-core at {AXE} (make frontend)")
    page.wait_for_load_state()  # axe's script tag needs the document's head
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.add_script_tag(url=page.evaluate("location.origin") + AXE_PATH)
    violations = page.evaluate("async () => (await axe.run(document)).violations")
    return [
        f"{v['impact']} {v['id']}: {v['help']} — {[n['target'] for n in v['nodes']][:3]}"
        for v in violations
        if v["impact"] in ("serious", "critical")
    ]


def shot(page: Any, name: str) -> None:
    """Screenshot for the docs, after checking the page with axe-core."""
    problems = accessibility_problems(page)
    assert not problems, f"{name}: " + "\n".join(problems)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def sign_in(page: Any, base: str, username: str, then: str) -> None:
    page.goto(f"{base}/login/?next={then}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "correct-horse-battery")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}{then}")


def publish(group: str, message: dict[str, Any]) -> None:
    """Send a message to a channel-layer group as an agent would. In a thread of its own:
    Playwright's sync API keeps an event loop in this one."""
    from workers.host.telemetry import make_layer
    from workers.host.telemetry import publish as send

    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(send(make_layer(settings.REDIS_URL), group, message))  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert not failure, failure


def request_batch(
    page: Any,
    base: str,
    command: str,
    who: str = "olivia",
    tier: str = "Dedicated",
    isolation: str = "process",
) -> int:
    """``who`` asks for a batch of project Vision (a whole GPU as a process sandbox unless
    ``tier`` and ``isolation`` say otherwise) through the form, and lands on its page; the
    sandbox's id."""
    sign_in(page, base, who, "/sandboxes/new/")
    page.select_option("select[name=project]", label="Vision")
    page.select_option("select[name=tier]", label=tier)
    page.select_option("select[name=image]", label="busybox")
    page.select_option("select[name=isolation]", isolation)
    page.select_option("select[name=run]", "batch")
    page.fill("input[name=command]", command)
    page.click("form.request-form button[type=submit]")
    page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))  # not the form's own URL
    return int(page.url.rstrip("/").rsplit("/", 1)[-1])
