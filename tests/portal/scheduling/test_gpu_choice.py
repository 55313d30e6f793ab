"""Choosing the GPU model (issue 40, item 1): a tier's menu, the request that names a model
is placed on that model only, and the live answer for each model on a menu its admin set.
The fleet: h100 (two dedicated H100-80GB) and a100 (two dedicated A100-80GB)."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling import digest
from portal.scheduling.preview import preview_by_model, preview_request
from tests.factories import TierFactory
from tests.portal.api.test_api import WRITE, api, create_body, post
from tests.portal.helpers import client_for, place_all, request, request_form

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

H100, A100 = "H100-80GB", "A100-80GB"


def ask(people: Any, catalog: Any, tier: str = "dedicated", **kw: Any) -> actions.SandboxRequest:
    return actions.SandboxRequest(
        project=people["project"], tier=catalog[tier], image=catalog["image"], isolation="container", **kw
    )


def run_on(people: Any, catalog: Any, model: str, gpus: int = 1) -> Sandbox:
    sandbox = request(
        people["owner"],
        people["project"],
        catalog["dedicated"],
        catalog["image"],
        gpu_count=gpus,
        gpu_model=model,
    )
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    return sandbox


def menu(catalog: Any, *models: str, tier: str = "dedicated") -> None:
    catalog[tier].gpu_models = list(models)
    catalog[tier].save()


def models_held(sandbox: Sandbox) -> set[str]:
    return set(Allocation.objects.filter(sandbox=sandbox, active=True).values_list("gpu__model", flat=True))


def test_a_request_naming_a_model_is_placed_on_that_model_only(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    for _ in range(2):
        assert models_held(run_on(people, catalog, A100)) == {A100}
    waiting = request(
        people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_model=A100
    )
    place_all()
    waiting.refresh_from_db()
    # Both A100s are taken; the free H100s are not what it asked for.
    assert waiting.state == "queued" and not models_held(waiting)
    assert waiting.request_summary == f"1 {A100}"
    anywhere = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    assert models_held(Sandbox.objects.get(pk=anywhere.pk)) == {H100}


def test_the_live_answer_for_each_model(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    # A tier offering every model of the fleet (no menu set) answers for the request only:
    # the openb cluster's seven models would be seven placement attempts a keystroke.
    place_all()
    assert preview_by_model(people["owner"], ask(people, catalog, gpu_model=H100)) == []
    menu(catalog, A100, H100)
    digest.clear()  # without the last cycle's state, no answer per model either
    assert preview_by_model(people["owner"], ask(people, catalog, gpu_model=H100)) == []
    answer = preview_request(people["owner"], ask(people, catalog, gpu_model=H100))
    assert answer.verdict == "now" and answer.message == "starts now on h100"
    run_on(people, catalog, H100, gpus=2)  # every dedicated H100 is taken
    by_model = {a.model: a for a in preview_by_model(people["owner"], ask(people, catalog, gpu_model=H100))}
    assert list(by_model) == [A100, H100]
    assert by_model[H100].picked and by_model[H100].preview.verdict == "waits"
    assert by_model[H100].preview.position == 1
    assert by_model[A100].preview.message == "starts now on a100" and not by_model[A100].picked
    # A tier that sells one model offers no choice, and its "any" means that model.
    menu(catalog, H100)
    assert preview_by_model(people["owner"], ask(people, catalog)) == []
    assert preview_request(people["owner"], ask(people, catalog)).verdict == "waits"


def test_a_model_the_tier_does_not_offer_is_refused_naming_its_menu(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    catalog["dedicated"].gpu_models = [A100]
    catalog["dedicated"].save()
    with pytest.raises(actions.SandboxRequestError) as refused:
        actions.check_request_sandbox(people["owner"], ask(people, catalog, gpu_model=H100))
    assert (
        refused.value.field == "gpu_model" and refused.value.message == "The tier Dedicated offers A100-80GB."
    )
    cpu = TierFactory(slug="cpu")
    with pytest.raises(actions.SandboxRequestError, match="runs on no GPU"):
        actions.check_request_sandbox(
            people["owner"], ask(people, {**catalog, "cpu": cpu}, "cpu", gpu_model=A100)
        )
    catalog["mig"].gpu_models = ["H200"]
    catalog["mig"].save()
    with pytest.raises(actions.SandboxRequestError, match=r"The H200 has no MIG profile 1g\.10gb"):
        actions.check_request_sandbox(
            people["owner"], ask(people, catalog, "mig", gpu_model="H200", mig_profile="1g.10gb")
        )


def test_the_form_offers_the_models_and_answers_per_model(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    owner = client_for(people["owner"])
    menu(catalog, A100, H100)
    place_all()  # the answers per model come from the last cycle's state only
    page = owner.get("/sandboxes/new/")
    assert page.status_code == 200
    field = page.context["form"]["gpu_model"]
    assert [value for value, _ in field.field.choices] == ["", A100, H100]
    assert page.context["tier_menus"][str(catalog["dedicated"].pk)] == [A100, H100]
    answer = owner.post("/sandboxes/preview/", request_form(people, catalog, gpu_model=H100))
    text = answer.content.decode()
    assert "Starts now on h100" in text and 'data-model="A100-80GB"' in text and "(your choice)" in text
    # A value outside the menu is refused on its field, naming the menu, not echoed.
    odd = owner.post("/sandboxes/preview/", request_form(people, catalog, gpu_model="<b>V100</b>"))
    assert "GPU model: The tier Dedicated offers A100-80GB, H100-80GB." in odd.content.decode()
    assert "<b>V100" not in odd.content.decode()


def test_the_api_takes_a_model_and_previews_each(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    client = api(people["member"], [WRITE])
    menu(catalog, A100, H100)
    place_all()
    preview = post(client, "/api/v1/sandboxes/preview/", create_body(gpu_model=A100)).json()
    assert preview["host"] == "a100"
    assert {a["model"]: a["verdict"] for a in preview["by_model"]} == {A100: "now", H100: "now"}
    created = post(client, "/api/v1/sandboxes/", create_body(gpu_model=A100), key="k1")
    assert created.status_code == 201, created.json()
    assert created.json()["gpu_model"] == A100
    refused = post(client, "/api/v1/sandboxes/", create_body(gpu_model="V100"), key="k2")
    assert refused.status_code == 400
    assert refused.json()["gpu_model"] == ["The tier Dedicated offers A100-80GB, H100-80GB."]


def test_a_tier_offers_only_the_mig_profiles_its_admin_chose(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    catalog["mig"].mig_profiles = ["1g.10gb", "2g.20gb"]
    catalog["mig"].save()
    with pytest.raises(actions.SandboxRequestError) as refused:
        actions.check_request_sandbox(people["owner"], ask(people, catalog, "mig", mig_profile="3g.40gb"))
    assert refused.value.field == "mig_profile"
    assert refused.value.message == "The tier Mig offers MIG profiles 1g.10gb, 2g.20gb."
    actions.check_request_sandbox(people["owner"], ask(people, catalog, "mig", mig_profile="2g.20gb"))
    page = client_for(people["owner"]).get("/sandboxes/new/")
    assert page.context["tier_profiles"] == {str(catalog["mig"].pk): ["1g.10gb", "2g.20gb"]}
