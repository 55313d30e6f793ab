"""Single sign-on in Chromium (issue 22's acceptance): a user signs in through the OpenID
Connect provider and lands in the projects their groups map to; taken out of a group at the
provider, they lose that project at their next sign-in. The portal is the real web server
(uvicorn) configured from the environment; the provider is django-oidc-provider's server.
Screenshots go to docs/screenshots/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from portal.accounts.models import Project
from portal.identity.models import GroupRule
from tests.browser.pages import shot, sign_in
from tests.e2e.platform import Platform
from tests.identity.servers import running_provider

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def sign_in_through_the_provider(page: Any, base: str, then: str, first_time: bool) -> None:
    page.goto(f"{base}{then}")  # sent to the sign-in page, which offers the provider
    page.click("#sso")
    if first_time:  # later, the provider remembers her and sends her straight back
        page.wait_for_selector("#idp-sign-in")
        page.fill("input[name=username]", "maria")
        page.fill("input[name=password]", "maria-idp-pass")
        page.click("#idp-sign-in")
    page.wait_for_url(f"{base}{then}", timeout=20_000)


def test_groups_at_the_provider_become_projects_in_the_portal(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    ml = Project.objects.create(name="ML Lab", slug="ml-lab")
    GroupRule.objects.create(source="oidc", group="ml-lab", project=ml, role="member")
    GroupRule.objects.create(source="oidc", group="vision-leads", project=people["project"], role="manager")
    with running_provider(tmp_path / "idp") as provider:
        (tmp_path / "logs").mkdir()
        portal = Platform(tmp_path / "var", tmp_path / "logs", extra_env=provider.settings_env())
        try:
            base = portal.start_web()
            provider.start(f"{base}/oidc/callback/")
            provider.user("maria", "maria-idp-pass", "ml-lab", "vision-leads")

            page.goto(f"{base}/login/")
            assert page.locator("#sso").inner_text() == "Sign in with Example University"
            shot(page, "sign-in-sso")
            sign_in_through_the_provider(page, base, "/projects/", first_time=True)
            listed = page.locator("main").inner_text()
            assert "ML Lab" in listed and "Vision" in listed and "NLP" not in listed
            shot(page, "projects-after-sso")

            provider.user("maria", "maria-idp-pass", "ml-lab")  # taken out of vision-leads
            page.click("form.whoami button")  # sign out of the portal
            sign_in_through_the_provider(page, base, "/projects/", first_time=False)
            listed = page.locator("main").inner_text()
            assert "ML Lab" in listed and "Vision" not in listed

            page.click("form.whoami button")
            sign_in(page, base, "ada", "/console/catalog/")  # a local admin still signs in
            page.locator("#group-rules").scroll_into_view_if_needed()
            assert "vision-leads" in page.locator("#group-rules").inner_text()
            shot(page, "console-group-rules")
        except BaseException:
            import sys

            sys.stderr.write(portal.logs())
            raise
        finally:
            portal.stop()
            # As running_platform does: connections opened under Playwright's loop would
            # block dropping the test database.
            from django.db import connections

            connections.close_all()
