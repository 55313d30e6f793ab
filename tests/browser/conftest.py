"""The browser tests' page: headless Chromium (Debian's, never a downloaded one) driven by
Playwright, with axe-core served as a file and every Content-Security-Policy report a failure.

``browser_page`` is one test's page; ``scenario_page`` is one page for all the steps of a
scenario (a class marked ``steps``), each step failing on what the CSP blocked during it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.browser.pages import AXE, AXE_PATH, CHROMIUM, CHROMIUM_ARGS, accept_dialog
from tests.workers.engines import require_engine


@contextmanager
def chromium_page(extra_args: tuple[str, ...] = ()) -> Iterator[tuple[Any, list[str]]]:
    """A page, and the list of what the Content-Security-Policy blocked on it so far."""
    require_engine(os.path.exists(CHROMIUM), "Chromium at /usr/bin/chromium")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls
    # are still plain synchronous ones.
    with pytest.MonkeyPatch.context() as monkeypatch, sync_playwright() as p:
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *extra_args])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("dialog", accept_dialog)
        # The pages allow scripts from their own origin only, so axe-core comes as one of
        # their files (Playwright answers for it), never as an inline script.
        page.route(
            f"**{AXE_PATH}", lambda route: route.fulfill(path=str(AXE), content_type="text/javascript")
        )
        # Whatever the Content-Security-Policy blocks (a script, a socket, a style) Chromium
        # reports on the console: every page the tests visit must run under the policy.
        blocked: list[str] = []
        page.on(
            "console",
            lambda message: (
                blocked.append(message.text) if "Content Security Policy" in message.text else None
            ),
        )
        try:
            yield page, blocked
        finally:
            browser.close()


@pytest.fixture
def browser_page() -> Iterator[Any]:
    with chromium_page() as (page, blocked):
        yield page
    assert not blocked, "blocked by the CSP:\n" + "\n".join(blocked[:10])


@pytest.fixture(scope="class")
def _scenario_chromium() -> Iterator[tuple[Any, list[str]]]:
    with chromium_page() as opened:
        yield opened


@pytest.fixture
def scenario_page(_scenario_chromium: tuple[Any, list[str]]) -> Iterator[Any]:
    """The scenario's page, as the previous step left it; this step fails on a CSP report."""
    page, blocked = _scenario_chromium
    seen = len(blocked)
    yield page
    assert len(blocked) == seen, "blocked by the CSP:\n" + "\n".join(blocked[seen:][:10])
