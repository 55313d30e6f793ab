"""Chromium through Playwright against the real platform: sign in, request, watch, stop.

Two scenarios, each one platform and one page for its steps (a class marked ``steps``): a
failure names the step, and the steps after it are skipped. Screenshots go to
docs/screenshots/ (the README shows them).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.pages import shot, sign_in, wait_until
from tests.conftest import make_catalog, make_people
from tests.e2e.platform import Platform, running_platform
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.slow,
]


@pytest.fixture(scope="class")
def world(scenario_db: None) -> dict[str, Any]:
    """The personas and the demo catalog, committed for the scenario's platform to see."""
    return {**make_people(), **make_catalog()}


@pytest.fixture(scope="class")
def platform(
    request: pytest.FixtureRequest, world: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    """The scenario's platform: its class says which simulated GPUs (SIM_GPUS) and which of
    them an admin pinned to a sharing mode (PINNED, index -> mode)."""
    from portal.fleet.models import Gpu
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    with running_platform(
        tmp_path_factory.mktemp("platform"), web=True, sim_gpus=request.cls.SIM_GPUS
    ) as platform:
        for index, mode in getattr(request.cls, "PINNED", {}).items():
            Gpu.objects.filter(host__name=platform.host, index=index).update(sharing_mode=mode)
        yield platform


@pytest.fixture
def base(platform: Platform) -> str:
    return f"http://127.0.0.1:{platform.port}"


def go_to_request_form(page: Any, base: str, tier: str) -> None:
    page.goto(f"{base}/sandboxes/new/")
    page.select_option("select[name=project]", label="Vision")
    page.select_option("select[name=tier]", label=tier)
    page.select_option("select[name=image]", label="busybox")


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestSignInRequestWatchAndStop:
    """A user signs in, requests a dedicated GPU, watches it run, uses its terminal, stops
    it and reads the bill; an admin then reshapes the MIG GPU for a whole-GPU instance."""

    SIM_GPUS = "H100-80GB:3:mig=2"  # GPUs 0 and 1 dedicated, GPU 2 in MIG mode

    def test_01_sign_in(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.goto(f"{base}/login/")
        shot(page, "login")
        page.fill("input[name=username]", "olivia")
        page.fill("input[name=password]", "correct-horse-battery")
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/sandboxes/")

    def test_02_request_form_previews_a_start_now(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        go_to_request_form(page, base, "Dedicated")
        page.fill("input[name=gpu_count]", "1")
        page.locator("input[name=gpu_count]").dispatch_event("change")
        page.locator("#preview .verdict-now", has_text="Starts now on").wait_for(timeout=10_000)
        assert "Dedicated" in page.locator(".tier-facts").inner_text()
        shot(page, "request-form")

    def test_03_request_opens_the_sandbox_page(self, scenario_page: Any) -> None:
        scenario_page.click("form.request-form button[type=submit]")
        scenario_page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))  # not the form's own URL

    def test_04_sandbox_reaches_running_with_a_live_chart(self, scenario_page: Any) -> None:
        page = scenario_page
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=60_000)
        chart = page.locator("#gpu-chart")
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3", timeout=30_000
        )
        first = int(chart.get_attribute("data-samples") or 0)
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {first + 1}",
            timeout=30_000,
        )
        assert page.locator("#gpu-chart canvas").count() == 2
        # No poll refreshes the status part's time left and cost so far: the page moves them on.
        for figure in ("time-left", "sandbox-cost"):
            was = page.locator(f"#{figure}").inner_text()
            wait_until(page, f"document.getElementById('{figure}').textContent !== {was!r}", timeout=15_000)
        assert "simulated" in page.locator("#chart-status").inner_text()
        assert page.locator(".badge.sim").count() >= 1  # the page says the host is simulated
        shot(page, "sandbox-running")

    def test_05_terminal_runs_a_command_in_the_container(self, scenario_page: Any) -> None:
        page = scenario_page
        page.click("[data-open-terminal]")
        page.locator(".terminal-status", has_text="Connected").wait_for(timeout=20_000)
        page.locator(".terminal-screen .xterm").click()
        page.keyboard.type("echo h''i\n")  # the quotes keep the echoed command line from matching
        wait_until(
            page,
            "[...document.querySelectorAll('.xterm-rows > div')].some(r => r.textContent.trim() === 'hi')",
            timeout=10_000,
        )
        page.locator("#terminal").scroll_into_view_if_needed()
        shot(page, "sandbox-terminal")

    def test_06_a_second_request_for_two_gpus_would_wait(self, scenario_page: Any, base: str) -> None:
        """One of the two dedicated GPUs is taken: two would wait (with a place, an earliest
        start and the one GPU that could start now instead)."""
        page = scenario_page
        go_to_request_form(page, base, "Dedicated")
        page.fill("input[name=gpu_count]", "2")
        page.locator("input[name=gpu_count]").dispatch_event("change")
        page.locator("#preview .verdict-waits").wait_for(timeout=10_000)
        waiting = page.locator("#preview .verdict").inner_text()
        assert "1st in line" in waiting and "Earliest start" in waiting, waiting
        assert "1 whole GPU(s) are free now on" in waiting, waiting
        shot(page, "request-form-waiting")
        page.go_back()
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=10_000)

    def test_07_stop_ends_the_sandbox_and_shows_its_cost(self, scenario_page: Any) -> None:
        page = scenario_page
        page.click("#stop-button")
        page.wait_for_selector("#sandbox-state:text('Stopped')", timeout=60_000)
        assert "EUR" in page.locator("#usage").inner_text()
        shot(page, "sandbox-stopped")

    def test_08_list_and_notifications(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.goto(f"{base}/sandboxes/")
        shot(page, "sandbox-list")
        page.click("#notifications-link")
        page.wait_for_url(f"{base}/notifications/")
        assert page.locator("ul.notifications li", has_text="is running on").count() >= 1
        shot(page, "notifications")

    def test_09_project_page_and_its_draft_invoice(self, scenario_page: Any, base: str) -> None:
        from django.utils import timezone

        from portal.billing.invoices import do_draft_invoices

        page = scenario_page
        page.click("nav >> text=Projects")
        shot(page, "projects")
        # The month's draft invoice, as the control worker's invoice tick would make it.
        do_draft_invoices(timezone.now().date().replace(day=1))
        page.click("text=Vision")
        page.wait_for_url(f"{base}/projects/vision/")
        assert "Unmeasured" in page.locator(".split-legend").inner_text()
        shot(page, "project")
        page.click("a[href*='/invoices/']")
        page.wait_for_url("**/invoices/*/")
        assert "Draft invoice" in page.locator("h1").inner_text()
        assert page.locator("table.grid tbody tr").count() == 1
        shot(page, "invoice")

    def test_10_admin_sees_the_fleet_is_simulated(
        self, scenario_page: Any, base: str, platform: Platform
    ) -> None:
        page = scenario_page
        page.click("text=Sign out")
        page.goto(f"{base}/login/?next=/console/fleet/")
        page.fill("input[name=username]", "ada")
        page.fill("input[name=password]", "correct-horse-battery")
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/console/fleet/")
        assert page.locator(f"text={platform.host}").count() >= 1
        assert page.locator(".badge.sim").count() >= 1
        shot(page, "fleet")
        page.goto(f"{base}/console/queue/")
        shot(page, "queue")

    def test_11_mig_relayout_preview_disturbs_nothing(
        self, scenario_page: Any, base: str, platform: Platform
    ) -> None:
        """The admin reshapes the MIG GPU (all its instances idle) for a whole-GPU 7g instance."""
        page = scenario_page
        page.click("text=defragmentation plans")
        page.wait_for_url(f"{base}/console/plans/")
        page.select_option("select[name=host]", label=platform.host)
        page.select_option("select[name=profile]", "7g.80gb")
        page.fill("input[name=max_disturbed]", "0")
        page.locator("form[action$='/plans/mig/'] button[value=preview]").click()
        page.locator("#plan-preview").wait_for(timeout=10_000)
        assert "create 7g.80gb@0 on GPU 2" in page.locator("#plan-preview").inner_text()
        assert "No running sandbox is disturbed." in page.locator("#plan-preview").inner_text()
        shot(page, "plan-preview")

    def test_12_mig_relayout_runs_to_done(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.locator("form[action$='/plans/mig/'] button[value=run]").click()
        page.wait_for_selector('.flash:has-text("started: make room for 7g.80gb")', timeout=10_000)
        deadline = time.monotonic() + 30
        while not page.locator(".plan .state-done").count() and time.monotonic() < deadline:
            time.sleep(0.5)
            page.reload()
        assert page.locator(".plan .state-done").count() == 1
        assert page.locator(".plan td", has_text="create 7g.80gb@0").count() == 1
        shot(page, "plans")
        page.goto(f"{base}/console/fleet/")
        assert page.locator(".mig-layout .slice", has_text="7g.80gb").count() == 1


SHARING_MODES = [
    ("Dedicated", {"input[name=gpu_count]": "1"}),
    ("Mig", {"select[name=mig_profile]": "1g.10gb"}),
    ("Mps", {"input[name=mps_memory_gib]": "8", "input[name=mps_thread_pct]": "30"}),
    ("Timeslice", {}),
]


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestEverySharingModeALoweredQuotaAndADrain:
    """A user runs one sandbox of each sharing mode; an admin lowers the project's quota and
    the next request is refused naming it; the admin drains a GPU and the user is told."""

    SIM_GPUS = "H100-80GB:4:mig=1"
    PINNED = {2: "mps", 3: "timeslice"}

    def test_01_sign_in(self, scenario_page: Any, base: str) -> None:
        sign_in(scenario_page, base, "olivia", "/sandboxes/new/")

    @pytest.mark.parametrize(("tier", "fields"), SHARING_MODES, ids=[tier for tier, _ in SHARING_MODES])
    def test_02_a_sandbox_of_this_mode_reaches_running(
        self, scenario_page: Any, base: str, tier: str, fields: dict[str, str]
    ) -> None:
        page = scenario_page
        go_to_request_form(page, base, tier)
        for selector, value in fields.items():
            if selector.startswith("select"):
                page.select_option(selector, value)
            else:
                page.fill(selector, value)
        page.locator("#preview .verdict-now").wait_for(timeout=10_000)
        page.click("form.request-form button[type=submit]")
        page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))  # not the form's own URL
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=60_000)

    def test_03_the_list_shows_four_running(self, scenario_page: Any, base: str) -> None:
        scenario_page.goto(f"{base}/sandboxes/")
        assert scenario_page.locator(".state-running").count() == 4
        shot(scenario_page, "sandbox-list-every-mode")

    def test_04_admin_caps_the_project_at_its_four_live_sandboxes(
        self, scenario_page: Any, base: str
    ) -> None:
        page = scenario_page
        page.click("text=Sign out")
        sign_in(page, base, "ada", "/admin/quotas/quotapolicy/add/")
        page.select_option("select[name=project]", label="Vision")
        page.fill("input[name=max_live_sandboxes]", "4")
        page.click("input[name=_save]")
        page.wait_for_url(f"{base}/admin/quotas/quotapolicy/")

    def test_05_admin_drains_the_gpu_of_the_dedicated_sandbox(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.goto(f"{base}/console/fleet/")
        # GPU 0 follows demand and serves the dedicated sandbox now (each row's mode form
        # lists every mode, so the row is found by what its GPU serves, not by an option).
        row = page.locator("tr", has=page.locator(".mode-now", has_text="now dedicated")).first
        row.locator("input[name=reason]").fill("fan failure")
        row.locator("button", has_text="Drain").click()
        page.locator(".flash", has_text="drained").wait_for(timeout=10_000)

    def test_06_fleet_shows_live_figures_a_busy_mig_slice_and_the_mps_share(self, scenario_page: Any) -> None:
        page = scenario_page
        wait_until(
            page,
            "[...document.querySelectorAll('[data-live-gpu]')].every(c => c.textContent.includes('°C'))",
            timeout=30_000,
        )
        assert page.locator(".mig-layout .slice.busy").count() == 1
        mps_row = page.locator("tr", has=page.locator(".mode-now", has_text="Pinned: MPS")).first
        assert "30%" in mps_row.inner_text()
        shot(page, "fleet-in-use")

    def test_07_audit_log_records_the_quota_and_the_drain(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.click("text=audit log")
        page.wait_for_url(f"{base}/console/audit/")
        assert page.locator("td", has_text="quotas.quotapolicy").count() == 1
        assert page.locator("td", has_text="fan failure").count() == 1
        shot(page, "audit-log")

    def test_08_catalog_and_its_tier_editor(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.goto(f"{base}/console/catalog/")
        shot(page, "catalog")
        page.click("a:has-text('Edit Mps')")
        page.locator("form.catalog-form").wait_for(timeout=10_000)
        shot(page, "catalog-edit-tier")

    def test_09_the_next_request_is_refused_naming_the_quota(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.click("text=Sign out")
        sign_in(page, base, "olivia", "/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Timeslice")
        page.select_option("select[name=image]", label="busybox")
        page.locator("#preview .verdict-refused", has_text="quota of 4 live sandboxes").wait_for(
            timeout=10_000
        )
        page.click("form.request-form button[type=submit]")
        assert (
            "Project Vision has reached its quota of 4 live sandboxes."
            in page.locator(".errors, .error").first.inner_text()
        )
        shot(page, "request-refused-by-quota")

    def test_10_the_user_is_told_of_the_drain(self, scenario_page: Any, base: str) -> None:
        page = scenario_page
        page.goto(f"{base}/notifications/")
        told = page.locator("ul.notifications li", has_text="taken out of service")
        assert told.count() == 1 and "fan failure" in told.inner_text()
        shot(page, "notifications-drained")
