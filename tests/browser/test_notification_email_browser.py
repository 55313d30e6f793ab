"""Email notifications through the whole platform: a user sets their choices in Chromium, runs
a batch, and the real control worker mails its start and its end to a real SMTP server on
loopback (aiosmtpd), with a link to the sandbox at the portal's public address; the kind
they turned off is not mailed. Screenshot: docs/screenshots/notification-email.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from portal.sandboxes.models import Notification, Sandbox
from tests.browser.pages import request_batch, shot, sign_in
from tests.e2e.platform import running_platform, wait_for
from tests.portal.smtp import Inbox, free_port
from tests.workers.engines import require_engine
from workers.drivers.process import bwrap_available

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.slow,
              pytest.mark.django_db(transaction=True)]  # fmt: skip
PUBLIC = "https://gpus.example.test"


def test_choices_set_in_the_browser_decide_what_the_control_worker_mails(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    require_engine(bwrap_available(), "bubblewrap")
    port = free_port()
    inbox = Inbox()
    server = Controller(inbox, hostname="127.0.0.1", port=port)
    server.start()
    mail = {
        "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(port),
        "DEFAULT_FROM_EMAIL": "gpushare <noreply@gpus.example.test>",
        "PORTAL_URL": PUBLIC,
    }
    page = browser_page
    try:
        with running_platform(
            tmp_path, web=True, sim_gpus="A100-80GB:1", driver="process", extra_env=mail
        ) as platform:
            base = f"http://127.0.0.1:{platform.port}"
            sign_in(page, base, "olivia", "/account/notifications/")
            assert "Mail goes to olivia@example.org" in page.locator("#mail-address").inner_text()
            assert "sends no mail" not in page.content()  # SMTP, not the console
            assert page.is_checked("#kind-started") and page.is_checked("#kind-ended")
            page.uncheck("#kind-started")
            page.check("#kind-queued")
            page.click("form.email-form button[type=submit]")
            page.locator(".flash", has_text="Saved. By email:").wait_for(timeout=10_000)
            assert not page.is_checked("#kind-started") and page.is_checked("#kind-queued")
            shot(page, "notification-email")

            page.context.clear_cookies()  # request_batch signs in itself
            request_batch(page, base, "sh -c 'echo trained; exit 0'")
            sandbox = Sandbox.objects.get(owner=people["owner"], batch=True)
            wait_for(
                lambda: inbox.messages, 120, f"a mail for sandbox {sandbox.pk}; logs:\n{platform.logs()}"
            )
            [(recipients, ended)] = inbox.messages
            assert recipients == ["olivia@example.org"]
            assert ended["Subject"] == f"[gpushare] Ended: Sandbox {sandbox.pk}: exited with code 0"
            body = str(ended.get_payload())
            assert f"/sandboxes/{sandbox.pk}/" in body
            assert f"{PUBLIC}/sandboxes/{sandbox.pk}/" in body
            # It started too (shown in the portal), but that kind was turned off above.
            assert Notification.objects.filter(sandbox=sandbox, kind="started", emailed_at=None).exists()
            assert Notification.objects.get(sandbox=sandbox, kind="ended").emailed_at is not None
    finally:
        server.stop()
