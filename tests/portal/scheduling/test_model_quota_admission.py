"""Quotas per GPU model through the portal (issue 40, item 2): a project at its H100 limit
is told so and offered the A100, a request for any model goes to the A100, a model whose
GPU-hours are used up is refused by name, the project page shows each limit, and the
console sets them (audited). The fleet: h100 (two dedicated H100-80GB) and a100 (two
dedicated A100-80GB)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.audit.models import AuditEntry
from portal.billing.models import UsageRecord
from portal.quotas.models import ModelQuota, QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling.preview import preview_request
from tests.portal.helpers import client_for, place_all, request, request_form
from tests.portal.scheduling.test_preview import assert_same, both_ways

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

H100, A100 = "H100-80GB", "A100-80GB"


def ask(people: Any, catalog: Any, **kw: Any) -> actions.SandboxRequest:
    return actions.SandboxRequest(
        project=people["project"],
        tier=catalog["dedicated"],
        image=catalog["image"],
        isolation="container",
        **kw,
    )


def run(people: Any, catalog: Any, **kw: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], **kw)
    place_all()
    sandbox.refresh_from_db()
    if sandbox.allocation_key:
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    return sandbox


def held_models(sandbox: Sandbox) -> set[str]:
    return set(Allocation.objects.filter(sandbox=sandbox, active=True).values_list("gpu__model", flat=True))


@pytest.fixture
def h100_limit(people: Any) -> ModelQuota:
    quota = QuotaPolicy.objects.create(project=people["project"], max_gpus=8)
    return ModelQuota.objects.create(quota=quota, name=H100, max_gpus=1)


@pytest.fixture
def menu(catalog: Any) -> None:
    """The dedicated tier's admin lists both models: the form answers for each."""
    catalog["dedicated"].gpu_models = [A100, H100]
    catalog["dedicated"].save()


def test_at_its_h100_limit_a_project_is_told_so_and_offered_the_a100(
    people: Any,
    catalog: Any,
    fleet: Any,
    sent_tasks: Any,
    h100_limit: ModelQuota,
    menu: None,
    monkeypatch: Any,
) -> None:
    assert held_models(run(people, catalog, gpu_model=H100)) == {H100}
    answer = assert_same(*both_ways(people["owner"], ask(people, catalog, gpu_model=H100), monkeypatch))
    assert answer.verdict == "waits"
    assert (
        answer.message == "quota: project vision holds 1 of its 1 H100-80GB GPU limit and this needs 1 more"
    )
    page = client_for(people["owner"]).post(
        "/sandboxes/preview/", request_form(people, catalog, gpu_model=H100)
    )
    text = page.content.decode()
    assert "holds 1 of its 1 H100-80GB GPU limit" in text
    assert "on A100-80GB: it starts now on a100" in text  # offered instead
    # A request for any model is placed on the A100, the model still within its limits.
    assert held_models(run(people, catalog)) == {A100}
    project_page = client_for(people["owner"]).get("/projects/vision/").content.decode()
    assert "H100-80GB GPUs held: 1 of 1" in project_page


def test_a_model_whose_gpu_hours_are_used_up_is_refused_and_any_goes_elsewhere(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, h100_limit: ModelQuota
) -> None:
    h100_limit.max_gpus, h100_limit.max_gpu_hours_month = None, 2
    h100_limit.save()
    first = run(people, catalog, gpu_model=A100)
    now = timezone.now()
    UsageRecord.objects.create(
        sandbox=first, allocation_key="k-old", project=people["project"], user=people["owner"],
        tier=catalog["dedicated"], gpu_model=H100, milli_gpu=1000, price_per_gpu_hour_micros=1,
        currency="EUR", started_at=now - timedelta(hours=3), ended_at=now - timedelta(minutes=30),
        duration=timedelta(hours=2.5),
    )  # fmt: skip
    with pytest.raises(actions.SandboxRequestError) as refused:
        actions.check_request_sandbox(people["owner"], ask(people, catalog, gpu_model=H100))
    assert refused.value.field == "gpu_model"
    assert refused.value.message == "Project Vision has used 2.5 of its 2 H100-80GB GPU-hours this month."
    refused_preview = preview_request(people["owner"], ask(people, catalog, gpu_model=H100))
    assert refused_preview.verdict == "refused"
    # Any model: the H100s are free, but their hours are spent; the last A100 takes it.
    assert held_models(run(people, catalog)) == {A100}
    waiting = run(people, catalog)
    assert waiting.state == "queued"
    assert waiting.pending_reason.startswith("waiting for 1 free GPU on one host")
    assert waiting.pending_reason.endswith(
        "; not on H100-80GB: quota: project vision has used 2.5 of its 2 H100-80GB GPU-hours this month"
    )


def test_the_console_sets_a_limit_per_model_and_the_audit_log_records_it(
    people: Any, catalog: Any, fleet: Any, h100_limit: ModelQuota
) -> None:
    admin = client_for(people["admin"])
    quota = h100_limit.quota
    assert quota is not None  # a project's limit (a department's has none)
    body = {"quota": quota.pk, "name": "Hopper", "gpu_models": [H100, "H200"], "max_gpus": "2"}
    saved = admin.post("/console/catalog/model-quotas/new/", body)
    assert saved.status_code == 302, saved.content.decode()[:2000]
    hopper = ModelQuota.objects.get(name="Hopper")
    assert hopper.covered == [H100, "H200"] and hopper.max_gpus == 2
    assert AuditEntry.objects.filter(target_type="quotas.modelquota").exists()
    catalog_page = admin.get("/console/catalog/").content.decode()
    assert "Hopper" in catalog_page and "H100-80GB, H200" in catalog_page
    nameless = admin.post(
        "/console/catalog/model-quotas/new/", {"quota": quota.pk, "name": "V9000", "max_gpus": "1"}
    )
    assert nameless.status_code == 400
    assert "Name a GPU model the fleet or the scheduler knows" in nameless.content.decode()
    limitless = admin.post("/console/catalog/model-quotas/new/", {"quota": quota.pk, "name": A100})
    assert "Set a limit on GPUs held, on GPU-hours a month, or both." in limitless.content.decode()
    assert client_for(people["owner"]).get("/console/catalog/model-quotas/new/").status_code == 302
