"""A time-slice replica in Chromium, against the real platform (web server, control worker, an
agent with simulated GPUs and sandboxes): the request form's live answer and the sandbox's
page say what a replica is, in the product's words (``portal.catalog.sharing``). Screenshots
go to docs/screenshots/timeslice-*.png."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.sharing import TIMESLICE, terms
from tests.browser.pages import shot, sign_in
from tests.e2e.platform import running_platform

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_time_slice_replica_is_stated_on_the_form_and_its_page(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    said = terms(TIMESLICE, replicas=4, gpu_memory_mib=81920)
    with running_platform(tmp_path, web=True, sim_gpus="A100-80GB:1", driver="simulated") as p:
        base = f"http://127.0.0.1:{p.port}"
        sign_in(page, base, "olivia", "/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Timeslice")
        page.select_option("select[name=image]", label="busybox")
        preview = page.locator("#preview .sharing-terms[data-sharing-mode=timeslice]")
        preview.wait_for(timeout=10_000)
        page.locator("#preview .verdict-now").wait_for(timeout=10_000)
        assert said.summary in preview.inner_text()
        assert "one replica's crash can end the others' work" in preview.inner_text().lower()
        shot(page, "timeslice-request-form")

        page.click("form.request-form button[type=submit]")
        page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=60_000)
        page.reload()  # its terms name the GPU it landed on: 1/4 of an A100-80GB's memory
        shown = page.locator("#sharing").inner_text()
        assert said.summary in shown and "1/4 of the GPU's memory (20.0 GiB)" in shown
        shot(page, "timeslice-sandbox")
