"""The accounts pages in Chromium against the real web server: a user makes an API token,
lists usage with it from curl, revokes it and the next call is a 401 (issue 16's
acceptance); the password pages. Screenshots go to docs/screenshots/."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.browser.pages import shot, sign_in
from tests.e2e.platform import running_platform
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def curl(base: str, key: str) -> tuple[int, dict[str, Any]]:
    """GET /api/v1/usage/ the way the acceptance says: from curl, with the key."""
    require_engine(shutil.which("curl") is not None, "curl")
    done = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {key}", f"{base}/api/v1/usage/"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    body, _, code = done.stdout.rpartition("\n")
    return int(code), json.loads(body)


def test_make_a_token_use_it_from_curl_revoke_it(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    with running_platform(tmp_path, web=True, sim_gpus="A100-80GB:1", driver="process") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        sign_in(page, base, "olivia", "/account/tokens/")
        page.fill("input[name=name]", "billing-export")
        page.check("input[name=scopes][value='read:usage']")
        page.select_option("select[name=expiry_days]", "30")
        page.click("form.token-form button[type=submit]")
        key = page.locator("#new-key").inner_text().strip()
        assert key.startswith("gps_")
        shot(page, "tokens")

        code, usage = curl(base, key)
        assert code == 200 and "results" in usage

        page.goto(f"{base}/account/tokens/")
        assert key not in page.content()  # shown once
        row = page.locator("tr", has_text="billing-export")
        row.locator("button", has_text="Revoke").click()
        page.locator(".flash", has_text="is revoked").wait_for(timeout=10_000)
        assert "revoked" in page.locator("tr", has_text="billing-export").inner_text()

        code, refused = curl(base, key)
        assert code == 401 and "revoked" in refused["detail"]


def test_the_password_pages(people: Any, catalog: Any, tmp_path: Path, browser_page: Any) -> None:
    page = browser_page
    with running_platform(tmp_path, web=True, sim_gpus="A100-80GB:1", driver="process") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        page.goto(f"{base}/login/")
        page.click("text=Forgot your password?")
        page.wait_for_url(f"{base}/password-reset/")
        shot(page, "password-reset")
        sign_in(page, base, "olivia", "/account/password/")
        page.fill("input[name=old_password]", "correct-horse-battery")
        page.fill("input[name=new_password1]", "a-new-long-passphrase-42")
        page.fill("input[name=new_password2]", "a-new-long-passphrase-42")
        page.click("main form button[type=submit]")  # not the header's sign-out button
        page.wait_for_url(f"{base}/account/password/done/")
        shot(page, "password-changed")
