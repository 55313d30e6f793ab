"""Inventories applied a batch at a time (``agent_inventories``, ``do_sync_inventories``): a
process serving many hosts sends a hundred in a message as it starts. A bad entry is refused
with a log line naming its host and the rest of the batch is applied; a batch costs a few
statements however many hosts; every host applied is alive, none is lost."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.control import tasks
from portal.control.hosts import mark_lost_hosts
from portal.fleet.inventory import do_sync_inventories
from portal.fleet.models import Gpu, GpuMode, Host, MigInstance
from portal.telemetry.alerts import do_record_alerts
from portal.telemetry.models import Alert
from tests.factories import inventory
from wire.telemetry import AlertMessage
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

pytestmark = pytest.mark.django_db


def gpus(host: str, spec: str = "V100M32:2") -> list[dict[str, Any]]:
    return [g.to_json() for g in SimulatedBackend(host, parse_sim_spec(spec)).list_gpus()]


def fleet(count: int, spec: str = "V100M32:2") -> list[Any]:
    return [inventory(f"node-{i:04d}", gpus(f"node-{i:04d}", spec), started=True) for i in range(count)]


def test_a_batch_with_one_malformed_entry_applies_the_rest_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batch = fleet(3)
    batch[1]["gpus"][0]["memory_mib"] = "lots"
    with caplog.at_level(logging.WARNING, logger="portal.fleet.inventory"):
        tasks.agent_inventories(batch)
    assert sorted(Host.objects.values_list("name", flat=True)) == ["node-0000", "node-0002"]
    assert Gpu.objects.count() == 4
    [line] = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert line.startswith("inventory of host node-0001 not applied: memory_mib: 'lots'")
    # Those applied are alive: none is lost.
    assert not Host.objects.filter(last_heartbeat_at__isnull=True).exists()
    assert mark_lost_hosts(timezone.now()) == 0


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda r: r.update(host="n" * 64), "host: 'nnnn"),
        (lambda r: r.update(gpus="none"), "gpus 'none' is not a list"),
        (lambda r: r.update(facts={"cpu_cores": -1, "memory_mib": 1}), "cpu_cores: -1"),
        (lambda r: r["gpus"][0].update(mig_enabled="yes"), "mig_enabled or mig_devices malformed"),
        (lambda r: r["gpus"].append(dict(r["gpus"][0])), "listed twice"),
    ],
)
def test_each_malformed_entry_is_refused_with_what_is_wrong(spoil: Any, says: str) -> None:
    batch = fleet(2)
    spoil(batch[0])
    outcome = do_sync_inventories(batch)
    [(_name, why)] = outcome.refused.items()
    assert says in why and [host.name for host in outcome.applied] == ["node-0001"]


def test_an_entry_that_is_not_an_object_is_named_by_its_place() -> None:
    outcome = do_sync_inventories(["node-x", *fleet(1)])
    assert outcome.refused == {"(entry 0, no host name)": "'node-x' is not an object"}
    assert Host.objects.filter(name="node-0000").exists()


def test_an_entry_the_database_refuses_costs_its_own_host_only(caplog: pytest.LogCaptureFixture) -> None:
    """A GPU replaced on a host (a new uuid at an index its old GPU's row still holds) breaks
    a constraint in the batch's statements: each host is then applied alone."""
    do_sync_inventories(fleet(3))
    batch = fleet(3)
    batch[1]["gpus"][0]["uuid"] = "GPU-replaced"
    batch[0]["facts"] = {"cpu_cores": 8, "memory_mib": 1024}
    with caplog.at_level(logging.WARNING, logger="portal.fleet.inventory"):
        outcome = do_sync_inventories(batch)
    assert list(outcome.refused) == ["node-0001"] and len(outcome.applied) == 2
    assert any("inventory of host node-0001 not applied" in r.getMessage() for r in caplog.records)
    assert Host.objects.get(name="node-0000").cpu_cores == 8  # the others' changes are in
    assert not Gpu.objects.filter(uuid="GPU-replaced").exists()


def test_a_gpu_two_hosts_of_a_batch_list_is_refused_for_the_second() -> None:
    batch = fleet(2)
    batch[1]["gpus"][0] = dict(batch[0]["gpus"][0], index=0)
    outcome = do_sync_inventories(batch)
    assert "is listed by host node-0000 too" in outcome.refused["node-0001"]
    assert Gpu.objects.filter(host__name="node-0000").count() == 2


def test_another_hosts_gpu_in_an_inventory_is_refused_and_left_as_it_was() -> None:
    """A host speaks for itself alone (issue 38): listing node-0000's GPU (to bring it back
    from unavailable, or rename it) costs node-0001 its inventory, not node-0000 its GPU."""
    do_sync_inventories(fleet(2))
    theirs = Gpu.objects.filter(host__name="node-0000").order_by("index").first()
    assert theirs is not None
    Gpu.objects.filter(pk=theirs.pk).update(state=Gpu.State.UNAVAILABLE, unavailable_reason="host lost")
    batch = [
        inventory("node-0001", [*gpus("node-0001"), dict(gpus("node-0000")[0], index=2, name="mine now")])
    ]
    outcome = do_sync_inventories(batch)
    assert f"{theirs.uuid} is host node-0000's, not node-0001's" in outcome.refused["node-0001"]
    theirs.refresh_from_db()
    assert (theirs.host.name, theirs.state, theirs.name) == ("node-0000", Gpu.State.UNAVAILABLE, theirs.name)


def test_a_hundred_hosts_cost_a_few_statements() -> None:
    """One at a time, a host's first inventory cost 3 statements and 5 more per GPU: 1,300
    for these hundred (SQLite splits a bulk statement past its 999 variables)."""

    def statements(batch: list[Any]) -> int:
        with CaptureQueriesContext(connection) as queries:
            tasks.agent_inventories(batch)
        return len(queries)

    assert statements(fleet(100)) <= 20  # first inventories: the hosts and GPUs made
    assert statements(fleet(100)) <= 10  # the same again: read, nothing to write
    assert Host.objects.count() == 100 and Gpu.objects.count() == 200


def test_a_batch_makes_mig_instances_and_follows_a_relayout() -> None:
    tasks.agent_inventories(fleet(2, "A100-80GB:2:mig=0"))
    first = Gpu.objects.get(host__name="node-0000", index=0)
    assert first.sharing_mode == GpuMode.MIG and first.mig_instances.count() > 0
    before = set(first.mig_instances.values_list("uuid", flat=True))
    tasks.agent_inventories(fleet(2, "A100-80GB:2"))  # MIG mode off on every GPU
    first.refresh_from_db()
    assert first.sharing_mode == GpuMode.AUTO and not MigInstance.objects.filter(uuid__in=before).exists()


def test_a_host_back_from_lost_has_its_gpus_back_and_one_whose_agent_started_its_alerts_closed() -> None:
    tasks.agent_inventories(fleet(2))
    Host.objects.update(state=Host.State.LOST)
    Gpu.objects.update(state=Gpu.State.UNAVAILABLE, unavailable_reason="host lost")
    raised = AlertMessage(
        type="alert.changed", key="node-0000:k1", state="raised", kind="temperature", host="node-0000",
        gpu="", sandbox=None, value=91.0, threshold=85.0, message="GPU hot", t=1_700_000_000_000,
    )  # fmt: skip
    do_record_alerts("node-0000", [raised])
    batch = fleet(2)
    batch[1]["started"] = False  # asked for its inventory, not restarted
    tasks.agent_inventories(batch)
    assert set(Host.objects.values_list("state", flat=True)) == {Host.State.UP}
    assert set(Gpu.objects.values_list("state", flat=True)) == {Gpu.State.AVAILABLE}
    assert Alert.objects.get(key="node-0000:k1").clear_reason == "agent restarted"


def test_a_host_listed_twice_counts_by_its_later_entry() -> None:
    batch = fleet(1)
    later = inventory("node-0000", gpus("node-0000", "V100M32:4"))
    outcome = do_sync_inventories([*batch, later])
    assert [host.name for host in outcome.applied] == ["node-0000"] and Gpu.objects.count() == 4
    spoiled = dict(later, gpus="none")
    outcome = do_sync_inventories([*fleet(1), spoiled])  # the newer is malformed: the host is refused
    assert not outcome.applied and "node-0000" in outcome.refused and Gpu.objects.count() == 4
