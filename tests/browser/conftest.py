"""The browser tests' page: headless Chromium (Debian's, never a downloaded one) driven by
Playwright, with axe-core served as a file and every Content-Security-Policy report a failure."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.pages import AXE, AXE_PATH, CHROMIUM, CHROMIUM_ARGS, accept_dialog
from tests.workers.engines import require_engine


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    require_engine(os.path.exists(CHROMIUM), "Chromium at /usr/bin/chromium")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls
    # are still plain synchronous ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
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
        yield page
        browser.close()
        assert not blocked, "blocked by the CSP:\n" + "\n".join(blocked[:10])
