"""A time-slice replica says what it is wherever it is offered, shown or billed: it shares
the whole GPU with up to N-1 others, nothing is reserved for it, another replica can use all
the GPU's memory, one replica's crash can end the others' work. The words have one source,
``portal.catalog.sharing``; every page and the API read them from there."""

from __future__ import annotations

import html
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.billing.invoices import do_draft_invoices, month_start
from portal.billing.models import UsageRecord
from portal.catalog.sharing import LABELS, MIG, MPS, TIMESLICE, terms
from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.portal.helpers import client_for, place_all, request, request_form

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

# The review's line (gpu-desk-review-3.md §3 (a)), as a time-slice replica's terms must say it.
REPLICA_FACTS = (
    "shares the whole gpu with up to 3 others",
    "no memory or compute reservation",
    "another replica can use all the gpu's memory",
    "one replica's crash can end the others' work",
)


def _text(page: str) -> str:
    """The page's words, as a reader sees them: tags out, entities decoded, spaces folded."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page))).lower()


def _says_what_a_replica_is(page: str) -> None:
    words = _text(page)
    missing = [fact for fact in REPLICA_FACTS if fact not in words]
    assert not missing, missing


def _replica(people: Any, catalog: Any) -> Sandbox:
    """A running time-slice sandbox on the fleet's time-sliced A100 (4 replicas)."""
    sandbox = request(people["owner"], people["project"], catalog["timeslice"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    sandbox.refresh_from_db()
    assert sandbox.state == "running"
    return sandbox


def test_a_time_slice_replicas_terms_say_what_it_is_and_is_not() -> None:
    said = terms(TIMESLICE, replicas=4, gpu_memory_mib=81920)
    _says_what_a_replica_is(f"{said.summary} {said.text}")
    assert "1/4 of the GPU's memory (20.0 GiB)" in said.text
    assert "not a part of the GPU set aside for it" in said.billing
    # Not knowing its GPU yet, the words give the rule rather than a number.
    assert "up to N-1 others" in terms(TIMESLICE).summary


def test_each_mode_says_what_it_gives_and_what_it_does_not() -> None:
    assert "isolated by the hardware" in terms(MIG).text and "own fault domain" in terms(MIG).text
    mps = terms(MPS).text
    assert "enforced for each of its processes by the GPU's MPS server" in mps
    assert "EXCLUSIVE_PROCESS" in mps and "ends every MPS client on the GPU" in mps
    assert all(terms(mode).summary and terms(mode).billing for mode in LABELS)


def test_the_request_form_states_each_offered_mode_before_a_tier_is_chosen(
    people: Any, catalog: Any, fleet: Any
) -> None:
    page = client_for(people["owner"]).get("/sandboxes/new/").content.decode()
    _says_what_a_replica_is(page)
    assert terms(MPS).summary in html.unescape(page)


def test_the_live_preview_of_a_time_slice_request_says_what_a_replica_is(
    people: Any, catalog: Any, fleet: Any
) -> None:
    form = request_form(people, catalog, tier=str(catalog["timeslice"].pk))
    answer = client_for(people["owner"]).post("/sandboxes/preview/", form, HTTP_HX_REQUEST="true")
    assert answer.status_code == 200
    _says_what_a_replica_is(answer.content.decode())
    # A dedicated tier's preview gives a whole GPU's terms, not a replica's.
    whole = client_for(people["owner"]).post("/sandboxes/preview/", request_form(people, catalog))
    assert "no memory or compute reservation" not in _text(whole.content.decode())
    assert terms("dedicated").summary.lower() in _text(whole.content.decode())


def test_a_time_slice_sandbox_page_says_what_it_shares(people: Any, catalog: Any, fleet: Any) -> None:
    sandbox = _replica(people, catalog)
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/").content.decode()
    _says_what_a_replica_is(page)
    assert "1/4 of the gpu's memory (20.0 gib)" in _text(page)  # the A100-80GB it is on


def test_the_fleet_and_gpu_pages_say_what_a_taken_replica_is(people: Any, catalog: Any, fleet: Any) -> None:
    _replica(people, catalog)
    admin = client_for(people["admin"])
    fleet_page = _text(admin.get("/console/fleet/").content.decode())
    assert "1 of 4 time-slice replicas taken" in fleet_page
    assert terms(TIMESLICE, replicas=4).summary.lower() in fleet_page
    gpu = Gpu.objects.get(host__name="a100", index=3)
    _says_what_a_replica_is(admin.get(f"/console/gpus/{gpu.uuid}/").content.decode())


def test_an_invoice_says_a_replica_is_billed_as_a_quarter_but_reserves_none_of_it(
    people: Any, catalog: Any, fleet: Any
) -> None:
    sandbox = _replica(people, catalog)
    actions.do_request_stop(sandbox.pk, people["owner"])
    actions.do_mark_stopped(sandbox.allocation_key, timezone.now() + timedelta(minutes=30))
    record = UsageRecord.objects.get(sandbox=sandbox)
    assert record.milli_gpu == 250
    [invoice] = do_draft_invoices(month_start(record.started_at), timezone.now() + timedelta(hours=1))
    page = client_for(people["owner"]).get(f"/projects/vision/invoices/{invoice.pk}/").content.decode()
    words = _text(page)
    assert "time-slice replica · billed as 25 % of a gpu" in words
    _says_what_a_replica_is(page)
    assert "as 1/4 of a gpu: that is its price, not a part of the gpu set aside for it" in words


def test_the_api_and_its_schema_give_the_same_words(people: Any, catalog: Any, fleet: Any) -> None:
    sandbox = _replica(people, catalog)
    token = ApiToken.issue(people["owner"], "t", list(ApiToken.Scope.values))[1]
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    shown = api.get(f"/api/v1/sandboxes/{sandbox.pk}/").json()
    assert shown["sharing_terms"] == terms(TIMESLICE).text
    schema = client_for(people["admin"]).get("/api/schema/?format=json").json()
    price_mode = schema["components"]["schemas"]["Price"]["properties"]["mode"]["description"]
    assert terms(TIMESLICE).summary in price_mode


def test_the_tier_forms_remind_admins_that_the_product_states_the_terms(people: Any, catalog: Any) -> None:
    admin = client_for(people["admin"])
    for path in ("/console/catalog/tiers/new/", f"/admin/catalog/tier/{catalog['timeslice'].pk}/change/"):
        page = admin.get(path)
        assert page.status_code == 200, path
        words = _text(page.content.decode())
        assert "gpushare itself states what its sharing mode gives" in words, path
        assert terms(TIMESLICE).summary.lower() in words, path


# Phrases only portal.catalog.sharing may hold: a template that wrote them itself would be a
# second definition, free to drift from the first.
OWN_WORDS = (
    "no memory or compute reservation",
    "can use all the gpu's memory",
    "crash can end",
    "isolated by the hardware",
    "enforced for each of its processes",
    "set aside for it",
)


def test_no_template_words_the_terms_itself() -> None:
    templates = Path(settings.BASE_DIR) / "templates"
    found = [
        f"{path.relative_to(templates)}: {phrase}"
        for path in templates.rglob("*.html")
        for phrase in OWN_WORDS
        if phrase in path.read_text().lower()
    ]
    assert not found, found
    # The pages that offer, show or bill a sandbox render them through the one tag.
    for name in (
        "sandboxes/new.html", "sandboxes/_preview.html", "sandboxes/detail.html", "console/fleet.html",
        "telemetry/gpu.html", "billing/invoice.html",
    ):  # fmt: skip
        assert "{% sharing_terms " in (templates / name).read_text(), name
