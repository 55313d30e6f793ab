"""Console → Hosts in Chromium against the real web server and a real agent (issue 38,
enrolment): an admin issues a new host its credentials (shown once), and revokes the running
agent's host, which its control worker then marks lost. Screenshots go to docs/screenshots/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from portal.fleet.models import Host, HostCredential
from tests.browser.pages import shot, sign_in
from tests.e2e.platform import running_platform, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_an_admin_enrols_a_host_and_revokes_another_from_the_console(
    people: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    with running_platform(tmp_path, web=True, sim_gpus="A100-80GB:2", driver="simulated") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        sign_in(page, base, "ada", "/console/hosts/")
        assert platform.host in page.locator("#host-credentials").inner_text()

        # Step 1: a new host's credentials, shown once.
        page.fill("input[name=host]", "gpu-rack7-01")
        page.click("button:has-text('Issue its credentials')")
        page.locator("#issued-credentials").wait_for()
        values = {
            name: page.locator(f"textarea[aria-label='{name}']").input_value()
            for name in ("redis_url", "host_key", "control_key.pub")
        }
        assert values["host_key"].startswith("ed25519:")
        assert "gpushare-host-gpu-rack7-01" in values["redis_url"]
        shot(page, "console-host-issued")
        page.click("text=Done")
        assert values["host_key"] not in page.content()  # shown once

        # Step 2: the running agent's host is revoked: cut off, then lost.
        row = page.locator("#host-credentials tr", has_text=platform.host)
        row.locator("summary", has_text="Revoke").click()
        shot(page, "console-hosts")
        row.locator("button", has_text=f"Revoke {platform.host}").click()
        page.locator(".flash", has_text="revoked").wait_for(timeout=10_000)
        assert not HostCredential.objects.get(host=platform.host).active
        wait_for(
            lambda: Host.objects.get(name=platform.host).state == Host.State.LOST,
            30,
            lambda: "the revoked host to be lost\n" + platform.logs(),
        )
