"""What the command-line client reads beside create/stop/extend: the request form's live
answer (``POST /api/v1/sandboxes/preview/``), a sandbox's history
(``GET /api/v1/sandboxes/{id}/events/``), and the sandbox's name, image, launch progress and
failure. Strict input (a 400 naming the field, never a 500) and another tenant's 404."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator

from portal.control import tasks
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox, SandboxEvent
from tests.portal.api.test_api import ALL, READ, WRITE, api, create_body, post
from tests.portal.helpers import client_for, place_all, request
from wire.spec import HandleJson

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture(autouse=True)
def _fresh_rate_limits() -> None:
    cache.clear()


def running(people: Any, catalog: Any, gpus: int = 1) -> Sandbox:
    sandbox = request(
        people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=gpus
    )
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    sandbox.refresh_from_db()
    return sandbox


# --- preview --------------------------------------------------------------------------------


def test_preview_says_where_it_would_start_and_writes_nothing(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    response = post(api(people["member"], [WRITE]), "/api/v1/sandboxes/preview/", create_body(gpu_count=2))
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["verdict"] == "now" and body["host"] in ("h100", "a100")
    # both hosts' simulated boards are NVSwitch-linked: the answer names the two GPUs it takes
    assert body["message"].startswith(f"starts now on {body['host']} (GPUs ")
    assert body["message"].endswith("all linked by NVLink, on NUMA node 1)")
    assert body["position"] == 0 and body["earliest_start"] is None and body["alternatives"] == []
    assert not Sandbox.objects.exists() and sent_tasks == []


def test_preview_of_a_full_fleet_says_why_it_waits_and_when_it_could_start(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    running(people, catalog, gpus=2)
    running(people, catalog, gpus=2)  # every dedicated GPU is taken (two per host)
    response = post(api(people["member"], [WRITE]), "/api/v1/sandboxes/preview/", create_body(gpu_count=1))
    body = response.json()
    assert response.status_code == 200 and body["verdict"] == "waits", body
    assert body["position"] == 1 and "waiting for 1 free GPU on one host" in body["message"]
    assert body["earliest_start"] is not None and body["host"] == ""


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"tier": "gold"}, "tier", "No such open tier."),
        ({"project": "nlp"}, "project", "No such project among those you may start sandboxes in."),
        ({"image": "ubuntu:latest"}, "image", "No such allowed image."),
        ({"gpu_count": "1"}, "gpu_count", "A valid integer is required."),
        ({"gpu_count": 9}, "gpu_count", "Ensure this value is less than or equal to 8."),
        ({"mps_memory_gib": 4}, "mps_memory_gib", "A dedicated tier does not take mps_memory_gib"),
        ({"isolation": "vm"}, "isolation", "The tier Dedicated allows isolation: container, process."),
        ({"privileged": True}, "privileged", "Unknown field"),
        ({"name": "a\x1b[31mb"}, "name", "Control characters"),
        ({"command": "sleep 1"}, "command", "Only batch runs take a command"),
    ],
)
def test_preview_checks_the_body_as_create_does(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, changes: dict[str, Any], field: str, says: str
) -> None:
    client = api(people["owner"], ALL)
    for path in ("/api/v1/sandboxes/preview/", "/api/v1/sandboxes/"):
        response = post(client, path, create_body(**changes))
        assert response.status_code == 400, (path, response.content)
        assert any(message.startswith(says) for message in response.json()[field]), (path, response.json())
    assert not Sandbox.objects.exists()


def test_preview_names_the_quota_that_would_refuse_it(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=1)
    running(people, catalog)
    response = post(api(people["owner"], ALL), "/api/v1/sandboxes/preview/", create_body())
    assert response.status_code == 400
    assert response.json() == {"project": ["Project Vision has reached its quota of 1 live sandboxes."]}


def test_preview_needs_the_write_scope(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    response = post(api(people["owner"], [READ]), "/api/v1/sandboxes/preview/", create_body())
    assert response.status_code == 403 and "write:sandboxes" in response.json()["detail"]
    assert Client().post("/api/v1/sandboxes/preview/", create_body()).status_code in (401, 403)


def test_preview_refuses_a_body_that_is_not_an_object(people: Any, catalog: Any, fleet: Any) -> None:
    client = api(people["owner"], ALL)
    for raw in ("[]", '"x"', "{", '{"project": "vision", "project": "nlp"}'):
        response = client.post("/api/v1/sandboxes/preview/", raw, content_type="application/json")
        assert response.status_code == 400, raw


# --- names and the sandbox's fields ------------------------------------------------------


def test_a_request_may_carry_a_name_and_answers_show_its_image_and_progress(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    client = api(people["owner"], ALL)
    created = post(client, "/api/v1/sandboxes/", create_body(name="resnet-sweep-3")).json()
    assert created["name"] == "resnet-sweep-3" and created["image"] == "busybox"
    assert created["launch_progress"] == "" and created["failure"] == ""
    Sandbox.objects.filter(pk=created["id"]).update(launch_progress="pulling x: 1 of 3 layers")
    shown = client.get(f"/api/v1/sandboxes/{created['id']}/").json()
    assert shown["launch_progress"] == "pulling x: 1 of 3 layers"
    assert post(client, "/api/v1/sandboxes/", create_body(name="x" * 61)).status_code == 400


# --- events -------------------------------------------------------------------------------


def test_events_are_the_sandboxes_history_oldest_first_in_pages(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog)
    client = api(people["member"], [READ])  # a member of its project may read its history
    first = client.get(f"/api/v1/sandboxes/{sandbox.pk}/events/", {"page_size": "2"}).json()
    events = list(first["results"])
    following = first["next"]
    while following:
        page = client.get(following).json()
        events += page["results"]
        following = page["next"]
    assert [e["to_state"] for e in events] == ["requested", "queued", "placing", "starting", "running"]
    assert [e["from_state"] for e in events][:2] == ["", "requested"]
    assert events[0]["actor"] == "olivia" and events[0]["message"].startswith("requested 1 GPU on ")
    assert len({e["id"] for e in events}) == 5 == SandboxEvent.objects.filter(sandbox=sandbox).count()
    assert set(events[0]) == {"id", "at", "from_state", "to_state", "actor", "message"}


HOST_PID = "4194301"  # what the process (bubblewrap) driver's handle carries as its ref


def test_no_host_pid_reaches_the_tenant(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    """Outside review: the running event said "running (process <host pid>)", on the sandbox's
    timeline and through the events API. It names the driver only; staff keep the handle."""
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    handle = HandleJson(
        driver="process", allocation_key=sandbox.allocation_key, sandbox_id=sandbox.pk, ref=HOST_PID
    )
    tasks.sandbox_launched(sandbox.allocation_key, handle, int(timezone.now().timestamp() * 1000))
    assert sandbox.events.get(to_state="running").message == "running (process)"
    events = api(people["owner"], [READ]).get(f"/api/v1/sandboxes/{sandbox.pk}/events/")
    page = client_for(people["owner"]).get(reverse("sandbox-detail", args=[sandbox.pk]))
    assert events.status_code == page.status_code == 200
    assert HOST_PID not in events.content.decode() and HOST_PID not in page.content.decode()
    sandbox.refresh_from_db()
    assert sandbox.handle == handle  # kept for staff (admin) and for the agent's later orders


def test_running_events_from_before_lose_their_refs(people: Any, catalog: Any, fleet: Any) -> None:
    """sandboxes 0016 on the events written before: the pid (and container or VM id) goes."""
    from django.apps import apps
    from django.db import connection

    migration = importlib.import_module("portal.sandboxes.migrations.0016_running_events_without_handle_refs")
    sandbox = running(people, catalog)
    old = SandboxEvent.objects.get(sandbox=sandbox, to_state="running")
    SandboxEvent.objects.filter(pk=old.pk).update(message=f"running (process {HOST_PID})")
    docker = SandboxEvent.objects.create(
        sandbox=sandbox, to_state="running", message="running (docker 0123456789ab)"
    )
    other = SandboxEvent.objects.create(
        sandbox=sandbox, to_state="stopped", message="running (process 1) said"
    )
    migration.drop_refs(apps, SimpleNamespace(connection=connection))
    old.refresh_from_db()
    docker.refresh_from_db()
    other.refresh_from_db()
    assert (old.message, docker.message) == ("running (process)", "running (docker)")
    assert other.message == "running (process 1) said"  # not a running event: left alone


def test_events_of_another_tenant_are_404_and_bad_parameters_400(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = running(people, catalog)
    outsider = api(people["outsider"], ALL)
    assert outsider.get(f"/api/v1/sandboxes/{sandbox.pk}/events/").status_code == 404
    assert api(people["admin"], [READ]).get(f"/api/v1/sandboxes/{sandbox.pk}/events/").status_code == 404
    assert api(people["admin"], ["admin"]).get(f"/api/v1/sandboxes/{sandbox.pk}/events/").status_code == 200
    owner = api(people["owner"], [READ])
    for params, field in (({"page_size": "0"}, "page_size"), ({"page_size": "²"}, "page_size"),
                          ({"offset": "1"}, "offset"), ({"page_size": "1", "x": "y"}, "x")):  # fmt: skip
        response = owner.get(f"/api/v1/sandboxes/{sandbox.pk}/events/", params)
        assert response.status_code == 400 and field in response.json(), (params, response.content)
    forged = owner.get(f"/api/v1/sandboxes/{sandbox.pk}/events/", {"cursor": "cD15ZXN0ZXJkYXk="})
    assert forged.status_code == 404  # p=yesterday: not a time, the documented "Invalid cursor"
    assert owner.get("/api/v1/sandboxes/99999999999999999999/events/").status_code == 404


def test_the_schema_documents_preview_and_events() -> None:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    preview = schema["paths"]["/api/v1/sandboxes/preview/"]["post"]
    assert preview["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/SandboxCreateRequest"
    )
    assert preview["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Preview")
    assert set(schema["components"]["schemas"]["Preview"]["properties"]) == {
        "verdict", "message", "host", "position", "earliest_start", "alternatives", "by_model",
    }  # fmt: skip
    events = schema["paths"]["/api/v1/sandboxes/{id}/events/"]["get"]
    assert {p["name"] for p in events["parameters"]} == {"id", "cursor", "page_size"}
    assert "404" in events["responses"]
    assert "name" in schema["components"]["schemas"]["SandboxCreateRequest"]["properties"]


def test_a_refusal_names_what_would_do(people: Any, catalog: Any, fleet: Any) -> None:
    """A script has no drop-downs to look at: an unknown project, tier or image is refused
    with the ones the caller may use."""
    body = create_body(project="nlp", tier="gold", image="ubuntu:latest")
    refused = post(api(people["owner"], ALL), "/api/v1/sandboxes/", body).json()
    assert refused["project"] == ["No such project among those you may start sandboxes in. Yours: vision."]
    assert refused["tier"] == ["No such open tier. Open: timeslice, mps, mig, dedicated."]
    assert refused["image"] == ["No such allowed image. Allowed: busybox."]
