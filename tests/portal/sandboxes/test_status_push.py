"""A sandbox's state changes reach its open pages over the socket they hold for its live chart
(portal/sandboxes/live.py), to those who may watch it, and only after the change commits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import transaction

from portal.asgi import application
from portal.sandboxes import actions, live
from tests.portal.helpers import client_for, place_all, request

# Consumers read in their own thread; so do the changes below, each thread's connection given
# back after (database_sync_to_async), or it would hold the test database open.
pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def sandbox(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> Any:
    s = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    s.refresh_from_db()
    return s


def _socket(user: Any, path: str) -> WebsocketCommunicator:
    """A browser's socket for ``user`` (signed in first: call it outside the event loop)."""
    cookie = f"sessionid={client_for(user).cookies['sessionid'].value}".encode()
    headers = [(b"host", b"localhost"), (b"origin", b"http://localhost"), (b"cookie", cookie)]
    return WebsocketCommunicator(application, path, headers=headers)


def test_the_owners_page_hears_of_a_stop_and_an_outsider_is_refused(people: Any, sandbox: Any) -> None:
    owner = _socket(people["owner"], f"/ws/sandboxes/{sandbox.pk}/")
    outsider = _socket(people["outsider"], f"/ws/sandboxes/{sandbox.pk}/")

    async def run() -> tuple[dict[str, Any], Any]:
        assert (await owner.connect())[0]
        assert (await outsider.connect())[0]
        refused = await outsider.receive_output(timeout=5)
        assert await owner.receive_nothing(timeout=0.3)  # subscribed (group_add landed)
        await database_sync_to_async(actions.do_request_stop)(sandbox.pk, people["owner"])
        pushed = await owner.receive_json_from(timeout=5)
        await owner.disconnect()
        await outsider.disconnect()
        return pushed, refused

    pushed, refused = asyncio.run(run())
    assert pushed == {"type": "sandbox.changed", "sandbox": sandbox.pk, "state": "stopping"}
    assert refused == {"type": "websocket.close", "code": 4403}


def test_a_change_rolled_back_is_not_pushed_before_a_commit(people: Any, sandbox: Any) -> None:
    owner = _socket(people["owner"], f"/ws/sandboxes/{sandbox.pk}/")

    def rolled_back() -> None:
        with pytest.raises(RuntimeError), transaction.atomic():
            live.sandbox_changed(sandbox.pk, "failed")
            raise RuntimeError("the change is undone")

    async def run() -> tuple[bool, dict[str, Any]]:
        assert (await owner.connect())[0]
        assert await owner.receive_nothing(timeout=0.3)
        await database_sync_to_async(rolled_back)()
        quiet = await owner.receive_nothing(timeout=0.5)
        await database_sync_to_async(actions.do_request_stop)(sandbox.pk, people["owner"])
        pushed = await owner.receive_json_from(timeout=5)
        await owner.disconnect()
        return quiet, pushed

    quiet, pushed = asyncio.run(run())
    assert quiet, "a rolled-back change was pushed"
    # The next commit's push carries the newest state (the page fetches its status once).
    assert pushed["state"] == "stopping"


def _pushed_after(user: Any, sandbox: Any, change: Any) -> list[dict[str, Any]]:
    """What ``user``'s page of ``sandbox`` hears once ``change`` (run in a thread) commits."""
    page = _socket(user, f"/ws/sandboxes/{sandbox.pk}/")

    async def run() -> list[dict[str, Any]]:
        assert (await page.connect())[0]
        assert await page.receive_nothing(timeout=0.3)
        await database_sync_to_async(change)()
        heard = [await page.receive_json_from(timeout=5)]
        while not await page.receive_nothing(timeout=0.3):
            heard.append(await page.receive_json_from(timeout=1))
        await page.disconnect()
        return [m for m in heard if m.get("type") == "sandbox.changed"]

    return asyncio.run(run())


def test_an_extension_is_pushed_though_the_state_stays(people: Any, sandbox: Any) -> None:
    """No poll refreshes the time left: a new line on the timeline is pushed as a change is."""
    from datetime import timedelta

    from portal.sandboxes.models import Sandbox

    Sandbox.objects.filter(pk=sandbox.pk).update(state="running", max_duration=timedelta(hours=1))
    heard = _pushed_after(
        people["owner"], sandbox, lambda: actions.do_extend(sandbox.pk, people["owner"], timedelta(hours=1))
    )
    assert heard == [{"type": "sandbox.changed", "sandbox": sandbox.pk, "state": "running"}]


def test_a_launchs_progress_is_pushed(people: Any, sandbox: Any) -> None:
    from portal.control import tasks
    from portal.sandboxes.models import Sandbox

    Sandbox.objects.filter(pk=sandbox.pk).update(state="starting")
    heard = _pushed_after(
        people["owner"], sandbox, lambda: tasks.launch_progress(sandbox.allocation_key, "pulling")
    )
    assert heard == [{"type": "sandbox.changed", "sandbox": sandbox.pk, "state": "starting"}]
    assert Sandbox.objects.get(pk=sandbox.pk).launch_progress == "pulling"
