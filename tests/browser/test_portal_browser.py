"""Chromium through Playwright against the real platform: sign in, request, watch, stop.

Screenshots go to docs/screenshots/ (the README shows them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.browser.pages import shot, sign_in, wait_until
from tests.e2e.platform import running_platform
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]


def test_sign_in_request_watch_and_stop(people: Any, catalog: Any, tmp_path: Path, browser_page: Any) -> None:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    page = browser_page
    # GPUs 0 and 1 dedicated, GPU 2 in MIG mode.
    with running_platform(tmp_path, web=True, sim_gpus="H100-80GB:3:mig=2") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        page.goto(f"{base}/login/")
        shot(page, "login")
        page.fill("input[name=username]", "olivia")
        page.fill("input[name=password]", "correct-horse-battery")
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/sandboxes/")

        page.goto(f"{base}/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Dedicated")
        page.select_option("select[name=image]", label="busybox")
        page.fill("input[name=gpu_count]", "1")
        page.locator("input[name=gpu_count]").dispatch_event("change")
        page.locator("#preview .verdict-now", has_text="Starts now on").wait_for(timeout=10_000)
        assert "Dedicated" in page.locator(".tier-facts").inner_text()
        shot(page, "request-form")
        page.click("form.request-form button[type=submit]")
        page.wait_for_url("**/sandboxes/*/")

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
        assert "simulated" in page.locator("#chart-status").inner_text()
        assert page.locator(".badge.sim").count() >= 1  # the page says the host is simulated
        shot(page, "sandbox-running")

        # A shell in the container, in the page.
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

        # One of the two dedicated GPUs is taken: two would wait (with a place, an earliest
        # start and the one GPU that could start now instead).
        page.goto(f"{base}/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Dedicated")
        page.select_option("select[name=image]", label="busybox")
        page.fill("input[name=gpu_count]", "2")
        page.locator("input[name=gpu_count]").dispatch_event("change")
        page.locator("#preview .verdict-waits").wait_for(timeout=10_000)
        waiting = page.locator("#preview .verdict").inner_text()
        assert "1st in line" in waiting and "Earliest start" in waiting, waiting
        assert "1 whole GPU(s) are free now on" in waiting, waiting
        shot(page, "request-form-waiting")
        page.go_back()
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=10_000)

        page.click("#stop-button")
        page.wait_for_selector("#sandbox-state:text('Stopped')", timeout=60_000)
        assert "EUR" in page.locator("#usage").inner_text()
        shot(page, "sandbox-stopped")

        page.goto(f"{base}/sandboxes/")
        shot(page, "sandbox-list")
        page.click("#notifications-link")
        page.wait_for_url(f"{base}/notifications/")
        assert page.locator("ul.notifications li", has_text="is running on").count() >= 1
        shot(page, "notifications")
        page.click("nav >> text=Projects")
        shot(page, "projects")
        # The month's draft invoice, as the control worker's invoice tick would make it.
        from django.utils import timezone

        from portal.billing.invoices import do_draft_invoices

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

        # An admin sees the fleet, and that this host's GPUs are simulated.
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

        # It reshapes the MIG GPU (all its instances idle) for a whole-GPU 7g instance.
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


def test_every_sharing_mode_a_lowered_quota_and_a_drain(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    """A user runs one sandbox of each sharing mode; an admin lowers the project's quota and
    the next request is refused naming it; the admin drains a GPU and the user is told."""
    from portal.fleet.models import Gpu
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    page = browser_page
    with running_platform(tmp_path, web=True, sim_gpus="H100-80GB:4:mig=1") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        Gpu.objects.filter(host__name=platform.host, index=2).update(sharing_mode="mps")
        Gpu.objects.filter(host__name=platform.host, index=3).update(sharing_mode="timeslice")
        sign_in(page, base, "olivia", "/sandboxes/new/")
        asks = [
            ("Dedicated", {"input[name=gpu_count]": "1"}),
            ("Mig", {"select[name=mig_profile]": "1g.10gb"}),
            ("Mps", {"input[name=mps_memory_gib]": "8", "input[name=mps_thread_pct]": "30"}),
            ("Timeslice", {}),
        ]
        for tier, fields in asks:
            page.goto(f"{base}/sandboxes/new/")
            page.select_option("select[name=project]", label="Vision")
            page.select_option("select[name=tier]", label=tier)
            page.select_option("select[name=image]", label="busybox")
            for selector, value in fields.items():
                if selector.startswith("select"):
                    page.select_option(selector, value)
                else:
                    page.fill(selector, value)
            page.locator("#preview .verdict-now").wait_for(timeout=10_000)
            page.click("form.request-form button[type=submit]")
            page.wait_for_url("**/sandboxes/*/")
            page.wait_for_selector("#sandbox-state:text('Running')", timeout=60_000)
        page.goto(f"{base}/sandboxes/")
        assert page.locator(".state-running").count() == 4
        shot(page, "sandbox-list-every-mode")

        # The admin caps Vision at the 4 live sandboxes it has.
        page.click("text=Sign out")
        sign_in(page, base, "ada", "/admin/quotas/quotapolicy/add/")
        page.select_option("select[name=project]", label="Vision")
        page.fill("input[name=max_live_sandboxes]", "4")
        page.click("input[name=_save]")
        page.wait_for_url(f"{base}/admin/quotas/quotapolicy/")
        # ... and drains the GPU of Olivia's dedicated sandbox.
        page.goto(f"{base}/console/fleet/")
        # GPU 0 follows demand and serves the dedicated sandbox now (each row's mode form
        # lists every mode, so the row is found by what its GPU serves, not by an option).
        row = page.locator("tr", has=page.locator(".mode-now", has_text="now dedicated")).first
        row.locator("input[name=reason]").fill("fan failure")
        row.locator("button", has_text="Drain").click()
        page.locator(".flash", has_text="drained").wait_for(timeout=10_000)
        # Live figures for every GPU, a MIG layout with a busy slice, the MPS share.
        wait_until(
            page,
            "[...document.querySelectorAll('[data-live-gpu]')].every(c => c.textContent.includes('°C'))",
            timeout=30_000,
        )
        assert page.locator(".mig-layout .slice.busy").count() == 1
        mps_row = page.locator("tr", has=page.locator(".mode-now", has_text="Pinned: MPS")).first
        assert "30%" in mps_row.inner_text()
        shot(page, "fleet-in-use")
        page.click("text=audit log")
        page.wait_for_url(f"{base}/console/audit/")
        assert page.locator("td", has_text="quotas.quotapolicy").count() == 1
        assert page.locator("td", has_text="fan failure").count() == 1
        shot(page, "audit-log")
        page.goto(f"{base}/console/catalog/")
        shot(page, "catalog")
        page.click("a:has-text('Edit Mps')")
        page.locator("form.catalog-form").wait_for(timeout=10_000)
        shot(page, "catalog-edit-tier")

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
        page.goto(f"{base}/notifications/")
        told = page.locator("ul.notifications li", has_text="taken out of service")
        assert told.count() == 1 and "fan failure" in told.inner_text()
        shot(page, "notifications-drained")
