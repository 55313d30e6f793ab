"""Choosing the GPU model in Chromium, against the real platform (web server, control worker,
an agent with a simulated H100 and A100 and simulated sandboxes): the form's menu, the live
answer for each model, a request for a model placed on it, and a project at its H100 limit
told so and offered the A100. Screenshots: docs/screenshots/gpu-choice.png,
docs/screenshots/model-quota.png."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from portal.quotas.models import ModelQuota, QuotaPolicy
from tests.browser.pages import shot, sign_in
from tests.e2e.platform import running_platform

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

H100, A100 = "H100-80GB", "A100-80GB"


def by_model(page: Any, model: str) -> str:
    return str(page.locator(f"#preview .by-model li[data-model='{model}']").inner_text())


def test_a_user_picks_the_model_and_sees_the_answer_for_each(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    catalog["dedicated"].gpu_models = [A100, H100]  # the admin's menu: the form answers for each
    catalog["dedicated"].save()
    quota = QuotaPolicy.objects.create(project=people["project"], max_gpus=8)
    ModelQuota.objects.create(quota=quota, name=H100, max_gpus=1)
    with running_platform(tmp_path, web=True, sim_gpus=f"{H100}:1;{A100}:1", driver="simulated") as p:
        base = f"http://127.0.0.1:{p.port}"
        sign_in(page, base, "olivia", "/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Dedicated")
        page.select_option("select[name=image]", label="busybox")
        options = page.locator("select[name=gpu_model] option").all_inner_texts()
        assert options == ["Any", A100, H100]
        page.select_option("select[name=gpu_model]", H100)
        page.locator("#preview .by-model li.picked[data-model='H100-80GB']").wait_for(timeout=10_000)
        assert "starts now" in by_model(page, H100) and "(your choice)" in by_model(page, H100)
        page.click("form.request-form button[type=submit]")
        page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))
        page.wait_for_selector("#sandbox-state:text('Running')", timeout=60_000)
        assert H100 in page.locator("main").inner_text()  # "1 H100-80GB" as asked

        # The project holds its one H100 of its H100 limit: asking for another waits, says
        # which limit holds it, and offers the A100, which would start now.
        page.goto(f"{base}/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Dedicated")
        page.select_option("select[name=image]", label="busybox")
        page.select_option("select[name=gpu_model]", H100)
        waits = page.locator("#preview .verdict.verdict-waits")
        waits.wait_for(timeout=10_000)
        assert "holds 1 of its 1 H100-80GB GPU limit" in waits.inner_text()
        assert "on A100-80GB: it starts now on" in waits.inner_text()
        assert "waits, 1st in line" in by_model(page, H100)
        assert "starts now" in by_model(page, A100)
        shot(page, "gpu-choice")
        page.select_option("select[name=gpu_model]", A100)
        page.locator("#preview .verdict.verdict-now").wait_for(timeout=10_000)
        assert "waits" in by_model(page, H100) and "(your choice)" in by_model(page, A100)

        page.goto(f"{base}/projects/vision/")
        limits = page.locator("main").inner_text()
        assert "H100-80GB GPUs held" in limits
        shot(page, "model-quota")
