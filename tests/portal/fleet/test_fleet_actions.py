"""Host and GPU states change only through ``portal.fleet.actions``: its transition table,
a fleet event per change, and a scan that finds no other writer in portal/ or workers/."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from portal.control import tasks
from portal.control.faults import do_drain_gpu, do_fault_event, do_undrain_gpu
from portal.control.hosts import mark_lost_hosts
from portal.fleet import actions
from portal.fleet.actions import GPU_TRANSITIONS, HOST_TRANSITIONS, FleetTransitionError
from portal.fleet.models import FleetEvent, Gpu, Host
from tests.factories import beat, inventory
from wire.messages import FaultReport
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[3]
WRITER = Path("portal/fleet/actions.py")


def _inventory(host: str, spec: str = "A100-80GB:2") -> list[dict[str, Any]]:
    return [g.to_json() for g in SimulatedBackend(host, parse_sim_spec(spec)).list_gpus()]


def _kinds(host: Host, since: Any = None) -> list[tuple[str, str]]:
    """(kind, GPU uuid or "") of the host's fleet events, oldest first."""
    events = FleetEvent.objects.filter(host=host).order_by("at", "pk")
    if since is not None:
        events = events.filter(at__gte=since)
    return [(e.kind, e.gpu.uuid if e.gpu else "") for e in events]


def _silence(host: Host, minutes: int = 5) -> None:
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=minutes))


@pytest.fixture
def host(db: Any, sent_tasks: Any) -> Host:
    """A host with two GPUs, as its agent's inventory reported it: up, both available."""
    tasks.agent_inventories([inventory("a100", _inventory("a100"))])
    return Host.objects.get(name="a100")


# --- through the control worker's tasks, as in production ---------------------------------


def test_losing_and_regaining_a_host_writes_fleet_events(host: Host, sent_tasks: Any) -> None:
    gpus = list(host.gpus.order_by("index").values_list("uuid", flat=True))
    began = timezone.now()
    _silence(host)
    assert mark_lost_hosts(timezone.now()) == 1
    host.refresh_from_db()
    assert host.state == Host.State.LOST
    assert set(host.gpus.values_list("state", flat=True)) == {Gpu.State.UNAVAILABLE}
    assert _kinds(host, began) == [("host_lost", ""), ("unavailable", gpus[0]), ("unavailable", gpus[1])]
    lost = FleetEvent.objects.get(host=host, kind="host_lost")
    assert "missed 3 heartbeats" in lost.message

    # It beats again: back up, and asked which GPUs are really there.
    sent_tasks.clear()
    regained = timezone.now()
    tasks.agent_heartbeats([beat(host.name)])
    host.refresh_from_db()
    assert host.state == Host.State.UP
    assert [t[1] for t in sent_tasks] == ["report_inventory"]
    assert _kinds(host, regained) == [("host_regained", "")]
    assert set(host.gpus.values_list("state", flat=True)) == {Gpu.State.UNAVAILABLE}
    # Its inventory: both GPUs are there again.
    tasks.agent_inventories([inventory(host.name, _inventory("a100"))])
    assert set(host.gpus.values_list("state", flat=True)) == {Gpu.State.AVAILABLE}
    assert _kinds(host, regained)[1:] == [("available", gpus[0]), ("available", gpus[1])]
    # A second beat or inventory changes nothing, so it writes nothing.
    count = FleetEvent.objects.count()
    tasks.agent_heartbeats([beat(host.name)])
    tasks.agent_inventories([inventory(host.name, _inventory("a100"))])
    assert FleetEvent.objects.count() == count


def test_a_gpu_the_agent_no_longer_sees_is_unavailable_until_it_does(host: Host) -> None:
    first, second = _inventory("a100")
    tasks.agent_inventories([inventory(host.name, [first])])
    assert Gpu.objects.get(uuid=second["uuid"]).state == Gpu.State.UNAVAILABLE
    assert FleetEvent.objects.filter(gpu__uuid=second["uuid"], kind="unavailable").count() == 1
    tasks.agent_inventories([inventory(host.name, [first, second])])
    assert Gpu.objects.get(uuid=second["uuid"]).state == Gpu.State.AVAILABLE
    assert FleetEvent.objects.filter(gpu__uuid=second["uuid"], kind="available").count() == 1


def test_a_drained_gpu_stays_drained_through_a_lost_host_and_a_missing_gpu(host: Host) -> None:
    """Only an admin undrains: neither the host coming back nor the GPU reappearing in its
    inventory puts a faulty GPU back in service."""
    first, second = _inventory("a100")
    assert do_fault_event(host.name, FaultReport(uuid=first["uuid"], kind="ecc_dbe", detail="2", t_ms=0))
    _silence(host)
    mark_lost_hosts(timezone.now())
    tasks.agent_heartbeats([beat(host.name)])
    tasks.agent_inventories([inventory(host.name, [second])])  # the faulty one is gone
    tasks.agent_inventories([inventory(host.name, [first, second])])  # and back
    gpu = Gpu.objects.get(uuid=first["uuid"])
    assert gpu.state == Gpu.State.DRAINED and gpu.drain_reason.startswith("double-bit ECC error")
    assert Gpu.objects.get(uuid=second["uuid"]).state == Gpu.State.AVAILABLE
    assert [k for k, uuid in _kinds(host) if uuid == first["uuid"]] == ["ecc_dbe"]


def test_drain_and_undrain_by_hand_write_events_and_keep_the_reason(host: Host, people: Any) -> None:
    gpu = host.gpus.order_by("index").first()
    assert gpu is not None
    assert do_drain_gpu(gpu.uuid, "fan noise", people["admin"]) is True
    assert do_drain_gpu(gpu.uuid, "again", people["admin"]) is False  # drained already
    gpu.refresh_from_db()
    assert (gpu.state, gpu.drain_reason) == (Gpu.State.DRAINED, "fan noise")
    assert do_undrain_gpu(gpu.uuid, people["admin"]) is True
    assert do_undrain_gpu(gpu.uuid, people["admin"]) is False
    gpu.refresh_from_db()
    assert (gpu.state, gpu.drain_reason) == (Gpu.State.AVAILABLE, "")
    events = list(FleetEvent.objects.filter(gpu=gpu).order_by("at", "pk"))
    assert [(e.kind, e.actor) for e in events] == [
        ("drained", people["admin"]),
        ("undrained", people["admin"]),
    ]


# --- the table itself ------------------------------------------------------------------------


def test_the_tables_name_every_state_and_no_self_transition() -> None:
    assert set(HOST_TRANSITIONS) == set(Host.State.values)
    assert set(GPU_TRANSITIONS) == set(Gpu.State.values)
    for table in (HOST_TRANSITIONS, GPU_TRANSITIONS):
        for state, targets in table.items():
            assert state not in targets
    for (was, to), _kind in actions.HOST_EVENTS.items():
        assert to in HOST_TRANSITIONS[was]
    assert {(w, t) for w, ts in HOST_TRANSITIONS.items() for t in ts} == set(actions.HOST_EVENTS)
    assert {(w, t) for w, ts in GPU_TRANSITIONS.items() for t in ts} == set(actions.GPU_EVENTS)


def test_a_transition_not_in_the_table_is_refused_and_writes_nothing(host: Host) -> None:
    count = FleetEvent.objects.count()
    with transaction.atomic():
        locked = Host.objects.select_for_update().get(pk=host.pk)
        actions.lose_host(locked, "test")
        with pytest.raises(FleetTransitionError, match="lost -> lost"):
            actions.lose_host(locked, "again")
    host.refresh_from_db()
    assert host.state == Host.State.LOST
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().filter(host=host).first()
        assert gpu is not None and gpu.state == Gpu.State.UNAVAILABLE
        actions.drain_gpu(gpu, "fault", "drained: fault", kind="xid")
        with pytest.raises(FleetTransitionError, match="drained -> unavailable"):
            actions._gpus_to([gpu], Gpu.State.UNAVAILABLE, "nope")
    gpu.refresh_from_db()
    assert gpu.state == Gpu.State.DRAINED
    with transaction.atomic():
        up = Host.objects.select_for_update().get(pk=host.pk)
        actions.regain_host(up)
        with pytest.raises(FleetTransitionError, match="up -> up"):
            actions.regain_host(up)
    # One event per change made: lost, its two GPUs unavailable, the drain, back up.
    assert FleetEvent.objects.count() == count + 5


# --- nothing else writes the states ----------------------------------------------------------


def _mentions_fleet_state(node: ast.AST) -> bool:
    """The expression names ``Host.State`` or ``Gpu.State``."""
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "State"
        and isinstance(n.value, ast.Name)
        and n.value.id in ("Host", "Gpu")
        for n in ast.walk(node)
    )


def _is_fleet_row(node: ast.AST) -> bool:
    """An expression that reads as a host or a GPU row: ``host``, ``gpu``, ``self.host``…"""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return any(word in name.lower() for word in ("host", "gpu"))


def _chain_root(node: ast.AST) -> str:
    """``Gpu`` for ``Gpu.objects.filter(...).update``, ``host`` for ``host.gpus.update``."""
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name):
                return f"{node.value.id}.{node.attr}"
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return ""


def _targets(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> list[ast.expr]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]


def _call_writes(node: ast.Call) -> bool:
    """A queryset or manager call that writes ``state`` on hosts or GPUs."""
    if not isinstance(node.func, ast.Attribute):
        return False
    method = node.func.attr
    if method not in ("update", "create", "get_or_create", "update_or_create", "bulk_update"):
        return False
    on_fleet = _is_fleet_row(ast.Name(_chain_root(node.func.value)))
    for keyword in node.keywords:
        if keyword.arg == "state" and (on_fleet or _mentions_fleet_state(keyword.value)):
            return True
        defaults = keyword.value if keyword.arg == "defaults" and on_fleet else None
        keys = defaults.keys if isinstance(defaults, ast.Dict) else []
        if any(isinstance(k, ast.Constant) and k.value == "state" for k in keys):
            return True
    arguments = [*node.args[1:], *(k.value for k in node.keywords if k.arg == "fields")]
    return method == "bulk_update" and on_fleet and any("state" in ast.unparse(a) for a in arguments)


def state_writes(source: str) -> list[int]:
    """Lines of ``source`` that write a host's or a GPU's state."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            fleet_value = node.value is not None and _mentions_fleet_state(node.value)
            states = [t for t in _targets(node) if isinstance(t, ast.Attribute) and t.attr == "state"]
            if any(fleet_value or _is_fleet_row(t.value) for t in states):
                found.add(node.lineno)
        elif isinstance(node, ast.Call) and _call_writes(node):
            found.add(node.lineno)
    return sorted(found)


@pytest.mark.parametrize(
    "code",
    [
        "host.state = Host.State.LOST",
        "self.host.state = 'lost'",
        "gpu.state, gpu.drain_reason = Gpu.State.DRAINED, reason",
        "g.state = Gpu.State.AVAILABLE",
        "Gpu.objects.filter(host=host).update(state=Gpu.State.UNAVAILABLE)",
        "Host.objects.filter(name=n, state=Host.State.LOST).update(state='up')",
        "host.gpus.filter(x=1).update(state='drained')",
        "Gpu.objects.create(host=h, uuid=u, state='drained')",
        "Gpu.objects.get_or_create(uuid=u, defaults={'state': 'available'})",
        "Gpu.objects.bulk_update(gpus, ['state'])",
    ],
)
def test_the_scan_finds_a_state_write(code: str) -> None:
    assert state_writes(code) == [1]


@pytest.mark.parametrize(
    "code",
    [
        "sandbox.state = to",
        "plan.state, plan.error = FleetPlan.State.FAILED, message",
        "Sandbox.objects.filter(host=host).update(state=S.QUEUED)",
        "Gpu.objects.filter(state=Gpu.State.AVAILABLE).update(sharing_mode='auto')",
        "Host.objects.filter(name=n).update(last_heartbeat_at=at)",
        "invoice.state = InvoiceState.FINALIZED",
    ],
)
def test_the_scan_leaves_other_writes(code: str) -> None:
    assert state_writes(code) == []


def test_no_module_but_fleet_actions_writes_a_host_or_gpu_state() -> None:
    offenders = []
    for package in ("portal", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative == WRITER or "migrations" in relative.parts:
                continue
            offenders += [f"{relative}:{line}" for line in state_writes(path.read_text())]
    assert offenders == [], "host/GPU state written outside portal/fleet/actions.py"
    assert state_writes((ROOT / WRITER).read_text()), "the scan no longer sees the actions' own writes"
