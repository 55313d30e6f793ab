"""Which messages the control worker believes (issue 38, signed messages): each as it comes
off the queue, with the headers a sender's ``before_task_publish`` signed, judged by
``portal.control.provenance`` before its handler runs."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context

from portal.control import provenance
from portal.fleet import credentials
from portal.fleet.models import Host
from portal.sandboxes.models import Allocation, Sandbox
from portal.telemetry.alerts import do_close_host_alerts
from portal.telemetry.models import Alert
from tests.conftest import seed_host
from tests.factories import beat
from wire import signing

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_keys() -> None:
    provenance.forget_keys()


@pytest.fixture
def enrolled(db: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, signing.Signer]:
    """Hosts a and b with their inventories, each enrolled with its own key, and a pool over
    "pool-"; Redis users are not needed here (``credentials._apply`` does nothing)."""
    monkeypatch.setattr(credentials, "_apply", lambda *a, **k: None)
    monkeypatch.setattr(credentials, "_admin", lambda: SimpleNamespace(execute_command=lambda *a: None))
    signers = {}
    for name in ("a", "b", "pool-1"):
        seed_host(name, "A100-80GB:1")
    for name in ("a", "b"):
        signers[name] = signing.Signer(
            signing.host_signer(name), signing.private_key(credentials.issue(name).host_key)
        )
    pool_key = credentials.issue("pool-", pool=True).host_key
    signers["pool"] = signing.Signer(signing.pool_signer("pool-"), signing.private_key(pool_key))
    return signers


def control_signer() -> signing.Signer:
    from django.conf import settings

    return signing.Signer(signing.CONTROL, signing.control_private_key(settings.SECRET_KEY))


def message(name: str, args: list[Any], signer: signing.Signer | None, **headers: Any) -> Any:
    """A task as the worker runs it for one message off the queue: its request holds the
    message's id and the headers it was sent with."""
    task_name, task_id = f"workers.control.{name}", uuid.uuid4().hex
    signed = signer.headers(task_name, task_id, args, {}) if signer is not None else {}
    request = Context(
        id=task_id, args=args, kwargs={}, headers={**signed, **headers}, called_directly=False, is_eager=False
    )
    return SimpleNamespace(name=task_name, request=request)


def admitted(name: str, args: list[Any], signer: signing.Signer | None, **headers: Any) -> bool:
    return provenance.admit(name, message(name, args, signer, **headers), args)


def forged_alerts() -> list[Alert]:
    return list(Alert.objects.filter(kind=Alert.Kind.FORGED).select_related("host"))


def test_a_host_speaks_for_itself_and_the_control_plane_for_anything(enrolled: dict[str, Any]) -> None:
    assert admitted("agent_heartbeats", [[beat("a")]], enrolled["a"])
    assert admitted("telemetry_alerts", ["b", []], enrolled["b"])
    assert admitted("schedule_cycle", [], control_signer())
    assert admitted("agent_heartbeats", [[beat("a")]], control_signer())
    assert not forged_alerts()


def test_a_heartbeat_claiming_another_host_is_dropped_and_raises_one_alert(enrolled: dict[str, Any]) -> None:
    assert not admitted("agent_heartbeats", [[beat("b")]], enrolled["a"])
    # One stranger in a round taints the whole message.
    assert not admitted("agent_heartbeats", [[beat("a"), beat("b")]], enrolled["a"])
    [alert] = forged_alerts()  # once an hour per host and task, not once per message
    assert alert.host.name == "a"  # the host whose key signed it
    assert "agent_heartbeats from host:a dropped: speaks for b" in alert.message
    assert alert.cleared_at is None
    # Its agent restarting (whoever holds the host may do that) does not close it.
    do_close_host_alerts(["a"], "agent restarted")
    alert.refresh_from_db()
    assert alert.cleared_at is None


def test_unsigned_altered_and_misattributed_messages_are_dropped(enrolled: dict[str, Any]) -> None:
    args = [[beat("b")]]
    assert not admitted("agent_heartbeats", args, None)
    signed = message("agent_heartbeats", args, enrolled["b"])
    args[0][0]["t_ms"] += 1  # altered after signing
    assert not provenance.admit("agent_heartbeats", signed, args)
    # a's signature offered as b's
    as_a = message("agent_heartbeats", [[beat("b")]], enrolled["a"])
    as_a.request.headers[signing.SIGNER_HEADER] = signing.host_signer("b")
    assert not provenance.admit("agent_heartbeats", as_a, as_a.request.args)
    assert not admitted("agent_heartbeats", [[beat("b")]], enrolled["a"], gpushare_sig="bm90IGEgc2lnbmF0dXJl")
    assert {alert.host.name for alert in forged_alerts()} <= {"a", "b"} and forged_alerts()


def test_a_host_may_not_send_the_control_planes_tasks(enrolled: dict[str, Any]) -> None:
    assert not admitted("email_notifications", [[1, 2, 3]], enrolled["a"])
    assert not admitted("schedule_cycle", [], enrolled["a"])
    assert "is the control plane's to send" in forged_alerts()[0].message


def test_a_revoked_or_rotated_key_is_no_longer_believed(enrolled: dict[str, Any]) -> None:
    assert admitted("agent_heartbeats", [[beat("a")]], enrolled["a"])
    credentials.rotate("a")
    provenance.forget_keys()  # as KEY_CACHE_S later
    assert not admitted("agent_heartbeats", [[beat("a")]], enrolled["a"])
    credentials.revoke("b")
    provenance.forget_keys()
    assert not admitted("agent_heartbeats", [[beat("b")]], enrolled["b"])


def test_a_pool_speaks_for_the_hosts_under_its_prefix_only(enrolled: dict[str, Any]) -> None:
    assert admitted("agent_heartbeats", [[beat("pool-1"), beat("pool-2")]], enrolled["pool"])
    assert not admitted("agent_heartbeats", [[beat("pool-1"), beat("a")]], enrolled["pool"])
    # A host's key is not a pool's, even for a host under the prefix.
    assert not signing.covers(signing.host_signer("pool-"), "pool-1")


def test_a_report_on_a_sandbox_is_judged_by_the_host_holding_it(
    enrolled: dict[str, Any], people: Any, catalog: Any
) -> None:
    from tests.portal.helpers import request

    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    gpu = Host.objects.get(name="b").gpus.get()
    key = uuid.uuid4().hex
    Sandbox.objects.filter(pk=sandbox.pk).update(host=gpu.host, allocation_key=key, state="running")
    Allocation.objects.create(
        sandbox=sandbox, gpu=gpu, kind="exclusive", device_uuid=gpu.uuid, milli_gpu=1000, active=True
    )
    assert not admitted("sandbox_stopped", [key, 0, "stopped"], enrolled["a"])
    assert admitted("sandbox_stopped", [key, 0, "stopped"], enrolled["b"])
    # A key no sandbox holds now (a late report from where one ran before): the handler ignores it.
    assert admitted("sandbox_stopped", [uuid.uuid4().hex, 0, "stopped"], enrolled["a"])
    # By id alone: any host it was ever on. It moved from b to a: both may still report.
    Allocation.objects.filter(sandbox=sandbox).update(active=False)
    other = Host.objects.get(name="a").gpus.get()
    Allocation.objects.create(
        sandbox=sandbox, gpu=other, kind="exclusive", device_uuid=other.uuid, milli_gpu=1000, active=True
    )
    assert admitted("storage_usage", [sandbox.pk, {}], enrolled["b"])
    assert admitted("storage_usage", [sandbox.pk, {}], enrolled["a"])
    assert not admitted("storage_usage", [sandbox.pk, {}], enrolled["pool"])
    assert not admitted("sandbox_over_share", ["a", {"allocation_key": "x"}], enrolled["b"])
    assert not admitted("agent_heartbeats", [["not a beat"]], enrolled["a"])  # malformed


def test_a_message_run_in_process_is_not_judged(db: Any) -> None:
    task: Any = SimpleNamespace(name="workers.control.tick", request=Context(called_directly=True))
    assert provenance.admit("tick", task, [])
