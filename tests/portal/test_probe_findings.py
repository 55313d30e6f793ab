"""The outside probe's findings (issue 16), each replayed from an ordinary account.

1 co-tenant figures and sockets that outlive their reason, 3 malformed values that were 500s,
7 commands shown without their quoting and bidi controls accepted. (2: tests/workers/
test_batch_output.py; 4: tests/workers/test_process_confinement.py; 5:
tests/portal/accounts/test_sign_in_throttle.py; 6: tests/portal/api/test_api.py
::test_bad_requests_name_the_field; 8: tests/portal/test_security.py
::test_websockets_accept_only_the_sites_own_origin.)
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from portal.accounts.models import ApiToken, Membership
from portal.asgi import application
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.portal.helpers import client_for, place_all, request
from wire.telemetry import gpu_group, host_sandbox_group

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture
def cotenants(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> dict[str, Any]:
    """Olivia (project Vision) and Oscar (project NLP) each hold a replica of one time-slice GPU."""
    mine = request(people["outsider"], people["other_project"], catalog["timeslice"], catalog["image"])
    theirs = request(people["owner"], people["project"], catalog["timeslice"], catalog["image"])
    place_all()
    mine.refresh_from_db()
    theirs.refresh_from_db()
    gpu = mine.allocations.get().gpu.uuid
    assert theirs.allocations.get().gpu.uuid == gpu, "both on the one time-slice GPU"
    return {"mine": mine, "theirs": theirs, "gpu": gpu, "host": mine.allocations.get().gpu.host.name}


def _socket(user: Any, path: str) -> WebsocketCommunicator:
    """A browser's socket for ``user`` (signed in first: call it outside the event loop)."""
    cookie = f"sessionid={client_for(user).cookies['sessionid'].value}".encode()
    headers = [(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)]
    return WebsocketCommunicator(application, path, headers=headers)


def _sample(gpu: str, *sandbox_ids: int) -> dict[str, Any]:
    figures = {"mem_mib": 1024, "util_pct": 50.0, "cost_micros": 12_345}
    return {"type": "gpu.sample", "gpu": gpu, "t": 1, "sandboxes": {str(pk): figures for pk in sandbox_ids}}


@pytest.mark.django_db(transaction=True)  # consumers read in their own thread
def test_finding_1_a_cotenant_sees_only_its_own_figures_on_a_shared_gpu(
    people: Any, cotenants: dict[str, Any]
) -> None:
    mine, theirs, gpu = cotenants["mine"], cotenants["theirs"], cotenants["gpu"]

    socket = _socket(people["outsider"], f"/ws/gpus/{gpu}/")

    async def run() -> tuple[dict[str, Any], bool]:
        assert (await socket.connect())[0]
        layer = get_channel_layer()
        await asyncio.sleep(0.2)  # the group_add lands
        await layer.group_send(gpu_group(cotenants["host"], gpu), _sample(gpu, mine.pk, theirs.pk))
        seen = await socket.receive_json_from(timeout=5)
        alert = {"type": "alert.changed", "gpu": gpu, "sandbox": theirs.pk, "state": "raised", "message": "x"}
        await layer.group_send(gpu_group(cotenants["host"], gpu), alert)
        quiet = await socket.receive_nothing(timeout=1)
        await socket.disconnect()
        return seen, quiet

    seen, no_cotenant_alert = asyncio.run(run())
    assert set(seen["sandboxes"]) == {str(mine.pk)}, "the co-tenant's memory, utilization and cost leaked"
    assert no_cotenant_alert, "the co-tenant's sandbox alert leaked"
    # Their admins see every tenant (unchanged), the alerts history the same rule as the socket.
    response = client_for(people["outsider"]).get(f"/telemetry/alerts/?gpu={gpu}")
    assert response.status_code == 200


@pytest.mark.django_db(transaction=True)  # consumers read in their own thread
@override_settings(STREAM_RECHECK_S=1)
def test_finding_1_a_gpu_socket_closes_once_its_sandbox_has_ended(
    people: Any, cotenants: dict[str, Any]
) -> None:
    mine, gpu = cotenants["mine"], cotenants["gpu"]

    socket = _socket(people["outsider"], f"/ws/gpus/{gpu}/")

    async def run() -> Any:
        assert (await socket.connect())[0]
        assert await socket.receive_nothing(timeout=1.5)  # allowed: stays open past a re-check
        await asyncio.to_thread(actions.do_request_stop, mine.pk, people["outsider"])
        await asyncio.to_thread(Sandbox.objects.filter(pk=mine.pk).update, state="stopped")
        await asyncio.to_thread(mine.allocations.update, active=False)
        closed = await socket.receive_output(timeout=5)
        await socket.disconnect()
        return closed

    assert asyncio.run(run()) == {"type": "websocket.close", "code": 4403}


@pytest.mark.django_db(transaction=True)  # consumers read in their own thread
@override_settings(STREAM_RECHECK_S=1)
def test_finding_1_a_sandbox_socket_closes_once_its_watcher_leaves_the_project(
    people: Any, cotenants: dict[str, Any]
) -> None:
    theirs = cotenants["theirs"]

    socket = _socket(people["member"], f"/ws/sandboxes/{theirs.pk}/")

    async def run() -> Any:
        assert (await socket.connect())[0]
        layer = get_channel_layer()
        await asyncio.sleep(0.2)
        own_figures = host_sandbox_group(cotenants["host"], theirs.pk)
        await layer.group_send(own_figures, _sample(cotenants["gpu"], theirs.pk))
        assert (await socket.receive_json_from(timeout=5))["sandboxes"]
        await asyncio.to_thread(Membership.objects.filter(user=people["member"]).delete)
        closed = await socket.receive_output(timeout=5)
        await socket.disconnect()
        return closed

    assert asyncio.run(run()) == {"type": "websocket.close", "code": 4403}


def _cursor(query: str) -> str:
    return base64.b64encode(query.encode()).decode()


@pytest.mark.parametrize(
    "path",
    # Lists ordered by time or id; a slug-ordered list (projects) takes any text as a position.
    ["/api/v1/sandboxes/", "/api/v1/usage/", "/api/v1/invoices/", "/api/v1/quotas/"],
)
@pytest.mark.parametrize("position", ["yesterday", "99999999999999999999999", "2026-13-45", "\u00b2"])
def test_finding_3_a_forged_cursor_is_a_404_not_a_500(people: Any, path: str, position: str) -> None:
    _token, key = ApiToken.issue(people["owner"], "probe", ["read:usage"])
    client = client_for(people["owner"])
    response = client.get(
        path, {"cursor": _cursor(f"o=0&r=0&p={position}")}, HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert response.status_code == 404, (response.status_code, response.content[:300])
    assert response.json()["detail"] == "Invalid cursor"


def test_finding_3_unicode_digits_are_refused_where_numbers_are_typed(
    people: Any, cotenants: dict[str, Any]
) -> None:
    owner, theirs = client_for(people["owner"]), cotenants["theirs"]
    extend = owner.post(
        f"/sandboxes/{theirs.pk}/extend/", {"hours": "\u00b2"}, headers={"HX-Request": "true"}
    )
    assert extend.status_code == 400
    assert Sandbox.objects.get(pk=theirs.pk).max_duration == theirs.max_duration
    preview = owner.post("/sandboxes/preview/", {"tier": "\u00b2", "project": "\u0663"})
    assert preview.status_code == 200
    history = owner.get(f"/telemetry/sandboxes/{theirs.pk}/history/", {"minutes": "\u00b2"})
    assert history.status_code == 400 and "minutes" in history.json()
    alerts = owner.get("/telemetry/alerts/", {"sandbox": "\u00b2"})
    assert alerts.status_code == 400 and "sandbox" in alerts.json()
    member = Membership.objects.get(user=people["member"])
    members = owner.post(
        f"/projects/{people['project'].slug}/members/", {"action": "remove", "membership": "\u00b9"}
    )
    assert members.status_code == 302 and Membership.objects.filter(pk=member.pk).exists()


def test_finding_3_deeply_nested_json_is_a_400(people: Any, cotenants: dict[str, Any]) -> None:
    _token, key = ApiToken.issue(people["owner"], "probe", ["write:sandboxes"])
    client = client_for(people["owner"])
    auth = {"Authorization": f"Bearer {key}"}
    nested: Any = 1
    for _ in range(40):
        nested = [nested]
    for body in ("[" * 100_000 + "]" * 100_000, json.dumps({"command": nested})):
        for path in ("/api/v1/sandboxes/", f"/api/v1/sandboxes/{cotenants['theirs'].pk}/extend/"):
            response = client.generic("POST", path, body, content_type="application/json", headers=auth)
            assert response.status_code == 400, (path, response.status_code, response.content[:200])


def test_finding_7_a_command_is_shown_as_the_argv_it_runs(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = request(
        people["owner"],
        people["project"],
        catalog["dedicated"],
        catalog["image"],
        command=("sh", "-c", "exit 0"),
    )
    page = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/status/").content.decode()
    assert "sh -c &#x27;exit 0&#x27;" in page, "the quoting the sandbox got is lost on display"


@pytest.mark.parametrize("control", ["\u202e", "\u2066", "\u200f", "\u061c"])
def test_finding_7_bidi_controls_are_refused_in_a_command(
    people: Any, catalog: Any, fleet: Any, control: str
) -> None:
    _token, key = ApiToken.issue(people["owner"], "probe", ["write:sandboxes"])
    body = {"project": "vision", "tier": "dedicated", "image": catalog["image"].name, "gpu_count": 1,
            "run": "batch", "command": f"echo {control}gnp.exe"}  # fmt: skip
    api = client_for(people["owner"]).post(
        "/api/v1/sandboxes/", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert api.status_code == 400 and "command" in api.json()
    form = client_for(people["owner"]).post(
        "/sandboxes/new/",
        {"project": people["project"].pk, "tier": catalog["dedicated"].pk, "image": catalog["image"].pk,
         "isolation": "container", "gpu_count": 1, "duration_hours": 1, "run": "batch",
         "command": f"echo {control}gnp.exe"},
    )  # fmt: skip
    assert form.status_code == 400 and "Bidirectional" in form.content.decode()
    assert not Sandbox.objects.filter(batch=True).exists()
