"""Who may see what: pages, API records and WebSockets, from the outsider's side too."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from portal.accounts.models import ApiToken
from portal.asgi import application
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture
def sandbox(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> Any:
    s = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    s.refresh_from_db()
    return s


def test_anonymous_is_sent_to_login(sandbox: Any) -> None:
    response = Client().get(f"/sandboxes/{sandbox.pk}/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert Client().get("/api/v1/usage/").status_code == 401


@pytest.mark.parametrize(
    ("persona", "page", "api"),
    [
        ("owner", 200, 200),
        ("member", 200, 200),
        ("admin", 200, 200),
        ("outsider", 404, 404),
    ],
)
def test_sandbox_page_and_api_record(people: Any, sandbox: Any, persona: str, page: int, api: int) -> None:
    c = client_for(people[persona])
    assert c.get(f"/sandboxes/{sandbox.pk}/").status_code == page
    assert c.get(f"/sandboxes/{sandbox.pk}/status/").status_code == page
    assert c.get(f"/api/v1/sandboxes/{sandbox.pk}/").status_code == api


def test_outsider_cannot_stop_and_member_may_not_stop_anothers(people: Any, sandbox: Any) -> None:
    assert client_for(people["outsider"]).post(f"/sandboxes/{sandbox.pk}/stop/").status_code == 404
    assert client_for(people["member"]).post(f"/sandboxes/{sandbox.pk}/stop/").status_code == 403
    sandbox.refresh_from_db()
    assert sandbox.state == "starting"
    assert client_for(people["owner"]).post(f"/sandboxes/{sandbox.pk}/stop/").status_code == 302
    sandbox.refresh_from_db()
    assert sandbox.state == "stopping"


def test_lists_show_only_own_projects(people: Any, sandbox: Any) -> None:
    assert client_for(people["outsider"]).get("/api/v1/sandboxes/").json()["results"] == []
    assert (
        f'href="/sandboxes/{sandbox.pk}/"'
        not in client_for(people["outsider"]).get("/sandboxes/").content.decode()
    )
    assert [s["id"] for s in client_for(people["member"]).get("/api/v1/sandboxes/").json()["results"]] == [
        sandbox.pk
    ]


def test_fleet_console_is_for_admins(people: Any, fleet: Any) -> None:
    assert client_for(people["admin"]).get("/console/fleet/").status_code == 200
    assert client_for(people["owner"]).get("/console/fleet/").status_code == 302  # to admin login


def test_api_token_is_stored_hashed_and_authenticates(people: Any, sandbox: Any) -> None:
    token, key = ApiToken.issue(people["owner"], "billing", ["read:usage"])
    assert key not in (token.key_hash, token.key_prefix) and len(token.key_hash) == 64
    ok = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert ok.status_code == 200
    bad = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION="Bearer gps_wrong")
    assert bad.status_code == 401 and "Invalid or revoked" in bad.json()["detail"]


def _ws_close_code(user: Any, path: str) -> tuple[bool, Any]:
    c = client_for(user)
    cookie = f"sessionid={c.cookies['sessionid'].value}".encode()

    async def run() -> tuple[bool, Any]:
        comm = WebsocketCommunicator(
            application,
            path,
            headers=[(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)],
        )
        connected, _ = await comm.connect()
        output = await comm.receive_output(timeout=3) if connected else None
        await comm.disconnect()
        return connected, output

    return asyncio.run(run())


@pytest.mark.django_db(transaction=True)  # the consumer reads the session in its own thread
@pytest.mark.parametrize("persona", ["outsider"])
def test_websocket_refuses_outsiders_with_4403(people: Any, sandbox: Any, persona: str) -> None:
    gpu_uuid = sandbox.allocations.get().device_uuid
    for path in (f"/ws/sandboxes/{sandbox.pk}/", f"/ws/gpus/{gpu_uuid}/", "/ws/fleet/"):
        connected, output = _ws_close_code(people[persona], path)
        assert connected and output == {"type": "websocket.close", "code": 4403}, path


@pytest.mark.django_db(transaction=True)  # the consumer reads the session in its own thread
def test_websocket_admits_members_and_admins(people: Any, sandbox: Any) -> None:
    def subscribed(user: Any, path: str) -> bool:
        cookie = f"sessionid={client_for(user).cookies['sessionid'].value}".encode()

        async def run() -> bool:
            comm = WebsocketCommunicator(
                application,
                path,
                headers=[(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)],
            )
            connected, _ = await comm.connect()
            quiet = await comm.receive_nothing(timeout=0.3)  # not closed on us
            await comm.disconnect()
            return connected and quiet

        return asyncio.run(run())

    gpu_uuid = sandbox.allocations.get().device_uuid
    assert subscribed(people["member"], f"/ws/sandboxes/{sandbox.pk}/")
    assert subscribed(people["member"], f"/ws/gpus/{gpu_uuid}/")
    assert subscribed(people["admin"], "/ws/fleet/")
    _connected, output = _ws_close_code(people["member"], "/ws/fleet/")
    assert output == {"type": "websocket.close", "code": 4403}


def test_websocket_from_a_foreign_origin_is_refused(people: Any, sandbox: Any) -> None:
    async def run() -> bool:
        comm = WebsocketCommunicator(
            application, f"/ws/sandboxes/{sandbox.pk}/", headers=[(b"origin", b"http://evil.example")]
        )
        connected, _ = await comm.connect()
        return connected

    assert asyncio.run(run()) is False


def test_request_form_offers_projects_where_the_user_may_request(people: Any, catalog: Any) -> None:
    from tests.factories import MembershipFactory, UserFactory

    # A billing viewer elsewhere in the project must not hide it from its members.
    MembershipFactory(user=UserFactory(username="bill"), project=people["project"], role="billing")
    page = client_for(people["member"]).get("/sandboxes/new/").content.decode()
    assert ">Vision</option>" in page and ">NLP</option>" not in page
    bill_page = client_for(people["project"].memberships.get(role="billing").user).get("/sandboxes/new/")
    assert ">Vision</option>" not in bill_page.content.decode()
