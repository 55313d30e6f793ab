"""GPUs that follow demand, and admins' pins, through the real scheduling cycle and pages."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from portal.audit.models import AuditEntry
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import FleetEvent, Gpu, GpuMode
from portal.fleet.modes import GpuModeError, do_set_gpu_mode
from portal.sandboxes import actions
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling.snapshot import build_snapshot
from scheduler.cluster import AUTO, DeviceGrant
from tests.portal.helpers import client_for, place_all, request
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def _ask(people: Any, catalog: Any, tier: str, **kw: Any) -> Sandbox:
    return request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)


def _modes_held() -> dict[str, set[str]]:
    """GPU uuid -> the allocation kinds live on it."""
    held: dict[str, set[str]] = defaultdict(set)
    for uuid, kind in Allocation.objects.filter(active=True).values_list("gpu__uuid", "kind"):
        held[uuid].add(kind)
    return held


def _stop_all() -> None:
    for sandbox in Sandbox.objects.filter(state__in=("placing", "starting", "running")):
        actions.do_mark_stopped(sandbox.allocation_key, timezone.now(), "done")


def test_gpus_following_demand_take_every_mode_one_at_a_time(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    whole = Gpu.objects.filter(mig_enabled=False)
    assert set(whole.values_list("sharing_mode", flat=True)) == {GpuMode.AUTO}  # an agent's new GPUs
    snapshot = build_snapshot()
    following = [g for h in snapshot.hosts for g in h.gpus if g.mode == AUTO]
    assert len(following) == 6 and all(g.replicas == 4 for g in following)  # it may become time-sliced

    shares = [_ask(people, catalog, "mps", mps_memory_mib=10240, mps_thread_pct=25) for _ in range(3)]
    replicas = [_ask(people, catalog, "timeslice") for _ in range(3)]
    dedicated = _ask(people, catalog, "dedicated", gpu_count=2)
    place_all()
    assert not Sandbox.objects.filter(state="queued").exists()
    held = _modes_held()
    assert all(len(kinds) == 1 for kinds in held.values()), held  # one mode per GPU at a time
    on = {s.pk: set(s.allocations.values_list("gpu__uuid", flat=True)) for s in [*shares, *replicas]}
    assert len(set.union(*(on[s.pk] for s in shares))) == 1  # the shares packed on one GPU
    assert len(set.union(*(on[s.pk] for s in replicas))) == 1  # and the replicas on another
    assert sorted(map(sorted, held.values())) == [["exclusive"]] * 2 + [["mps"], ["timeslice"]]
    assert dedicated.allocations.count() == 2

    _stop_all()  # every GPU idle again: any mode may take any of them
    everything = _ask(people, catalog, "dedicated", gpu_count=4)
    place_all()
    everything.refresh_from_db()
    assert everything.state == "starting"
    assert set(everything.allocations.values_list("gpu__host__name", flat=True)) == {"a100"}


def test_a_pinned_gpu_takes_only_its_mode(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    for gpu in Gpu.objects.filter(mig_enabled=False):
        do_set_gpu_mode(gpu.uuid, GpuMode.MPS, people["admin"])
    whole = _ask(people, catalog, "dedicated")
    replica = _ask(people, catalog, "timeslice")
    share = _ask(people, catalog, "mps", mps_memory_mib=4096, mps_thread_pct=10)
    place_all()
    for sandbox in (whole, replica, share):
        sandbox.refresh_from_db()
    assert (whole.state, replica.state, share.state) == ("queued", "queued", "starting")
    assert whole.pending_reason == "no GPU in the fleet offers dedicated sharing"
    assert replica.pending_reason == "no GPU in the fleet offers timeslice sharing"

    gpu = Gpu.objects.get(host__name="a100", index=3)
    do_set_gpu_mode(gpu.uuid, GpuMode.AUTO, people["admin"])  # follows demand again: takes the rest
    place_all()
    assert set(Sandbox.objects.filter(pk__in=[whole.pk, replica.pk]).values_list("state", flat=True)) == {
        "starting",
        "queued",
    }  # one GPU, one mode: the dedicated sandbox or the replica, not both


def test_pinning_a_gpu_that_holds_another_mode_is_refused_on_the_fleet_page(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    share = _ask(people, catalog, "mps", mps_memory_mib=4096, mps_thread_pct=10)
    place_all()
    gpu = share.allocations.get().gpu
    admin = client_for(people["admin"])

    page = admin.get("/console/fleet/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Follows demand — now MPS" in text and "Follows demand — now idle" in text
    assert text.count('class="inline mode-form"') == 6  # every GPU not in MIG mode; the MIG ones have none

    refused = admin.post(f"/console/gpus/{gpu.uuid}/mode/", {"mode": "dedicated"})
    assert refused.status_code == 400
    assert (
        "holds 1 MPS sandbox: it can be pinned to dedicated once they have stopped"
        in refused.content.decode()
    )
    gpu.refresh_from_db()
    assert gpu.sharing_mode == GpuMode.AUTO

    pinned = admin.post(f"/console/gpus/{gpu.uuid}/mode/", {"mode": "mps"})
    assert pinned.status_code == 302
    gpu.refresh_from_db()
    assert gpu.sharing_mode == GpuMode.MPS
    assert "Pinned: MPS" in admin.get("/console/fleet/").content.decode()
    assert (f"host.{gpu.host.name}", "gpu_mode", (gpu.uuid, "mps")) in sent_tasks  # for the daemon
    event = FleetEvent.objects.get(gpu=gpu, kind="mode")
    assert event.message == "pinned to MPS (was follows demand)" and event.actor == people["admin"]
    assert AuditEntry.objects.filter(target_type="fleet.gpu", target_id=str(gpu.pk)).exists()

    mig = Gpu.objects.filter(mig_enabled=True).first()
    assert mig is not None
    nonsense = admin.post(f"/console/gpus/{mig.uuid}/mode/", {"mode": "auto"})
    assert nonsense.status_code == 400 and "is in MIG mode" in nonsense.content.decode()
    assert admin.post(f"/console/gpus/{gpu.uuid}/mode/", {"mode": "mig"}).status_code == 400


def test_the_fleet_page_and_its_pins_are_for_admins_only(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    gpu = Gpu.objects.filter(mig_enabled=False).first()
    assert gpu is not None
    for who in ("owner", "outsider"):
        user = client_for(people[who])
        assert user.get("/console/fleet/").status_code == 302  # to the admin's sign-in
        assert user.post(f"/console/gpus/{gpu.uuid}/mode/", {"mode": "mps"}).status_code == 302
    gpu.refresh_from_db()
    assert gpu.sharing_mode == GpuMode.AUTO and not FleetEvent.objects.filter(kind="mode").exists()


def test_the_admin_pins_through_the_same_rule(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    share = _ask(people, catalog, "mps", mps_memory_mib=4096, mps_thread_pct=10)
    place_all()
    gpu = share.allocations.get().gpu
    admin = client_for(people["admin"])
    form = {
        "host": gpu.host_id, "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "model": gpu.model,
        "memory_mib": gpu.memory_mib, "sharing_mode": "timeslice", "timeslice_replicas": 4,
    }  # fmt: skip
    refused = admin.post(f"/admin/fleet/gpu/{gpu.pk}/change/", form)
    assert refused.status_code == 200 and "holds 1 MPS sandbox" in refused.content.decode()
    gpu.refresh_from_db()
    assert gpu.sharing_mode == GpuMode.AUTO
    saved = admin.post(f"/admin/fleet/gpu/{gpu.pk}/change/", {**form, "sharing_mode": "mps"})
    assert saved.status_code == 302
    gpu.refresh_from_db()
    assert gpu.sharing_mode == GpuMode.MPS and FleetEvent.objects.filter(gpu=gpu, kind="mode").exists()


def test_a_booking_rechecks_the_gpus_mode_and_mps_room(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    """Decisions made on an older snapshot: the booking's own checks refuse what no longer fits."""
    gpu = Gpu.objects.get(host__name="a100", index=0)
    first = _ask(people, catalog, "mps", mps_memory_mib=40960, mps_thread_pct=60)
    late = _ask(people, catalog, "mps", mps_memory_mib=40960, mps_thread_pct=60)
    whole = _ask(people, catalog, "dedicated")
    replica = _ask(people, catalog, "timeslice")

    def share(sandbox: Sandbox) -> tuple[DeviceGrant, ...]:
        return (DeviceGrant(gpu.uuid, gpu.uuid, "mps", 600, mps_memory_mib=40960, mps_thread_pct=60),)

    assert actions.do_place(first.pk, "a100", share(first))
    assert not actions.do_place(late.pk, "a100", share(late))  # 120 % of the threads: no room
    assert not actions.do_place(whole.pk, "a100", (DeviceGrant(gpu.uuid, gpu.uuid, "exclusive", 1000),))
    assert not actions.do_place(
        replica.pk, "a100", (DeviceGrant(gpu.uuid, gpu.uuid, "timeslice", 250, replica=0),)
    )
    other = Gpu.objects.get(host__name="a100", index=1)
    do_set_gpu_mode(other.uuid, GpuMode.TIMESLICE)  # pinned after the cycle's snapshot
    assert not actions.do_place(whole.pk, "a100", (DeviceGrant(other.uuid, other.uuid, "exclusive", 1000),))
    assert actions.do_place(
        replica.pk, "a100", (DeviceGrant(other.uuid, other.uuid, "timeslice", 250, replica=0),)
    )
    assert set(Sandbox.objects.filter(state="queued").values_list("pk", flat=True)) == {late.pk, whole.pk}
    with pytest.raises(GpuModeError, match="holds 1 time-slice sandbox"):
        do_set_gpu_mode(other.uuid, GpuMode.DEDICATED)


@pytest.mark.parametrize("one_size", [False, True])
def test_mps_one_size_per_gpu_keeps_a_gpu_to_its_first_shares_size(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, settings: Any, one_size: bool
) -> None:
    """MPS_ONE_SIZE_PER_GPU: beside a 40 GiB share, a 10 GiB share's process could take 40 GiB
    (the server's limits bind each process, the largest share's are the ceiling), so the
    cycle, a booking made outside it and the preview keep an MPS GPU to one size. Off (the
    default), shares of any size pack onto it."""
    from portal.scheduling.preview import preview_request

    settings.MPS_ONE_SIZE_PER_GPU = one_size
    gpu = Gpu.objects.get(host__name="a100", index=2)  # the fleet's one MPS GPU
    big = _ask(people, catalog, "mps", mps_memory_mib=40960, mps_thread_pct=40)
    place_all()
    small = _ask(people, catalog, "mps", mps_memory_mib=10240, mps_thread_pct=10)
    place_all()
    small.refresh_from_db()
    assert small.state == ("queued" if one_size else "starting")
    if one_size:
        assert "beside shares of that size" in small.pending_reason, small.pending_reason
        share = DeviceGrant(gpu.uuid, gpu.uuid, "mps", 100, mps_memory_mib=10240, mps_thread_pct=10)
        assert not actions.do_place(small.pk, "a100", (share,))  # a stale decision: refused too
        req = actions.SandboxRequest(
            project=people["project"], tier=catalog["mps"], image=catalog["image"], isolation="container",
            mps_memory_mib=20480, mps_thread_pct=20,
        )  # fmt: skip
        answer = preview_request(people["owner"], req)
        assert answer.alternatives == [
            "an MPS share of 40 GiB and 40% of the threads (the size its GPU serves) is free now on a100"
        ]
    assert set(Allocation.objects.filter(active=True, gpu=gpu).values_list("sandbox_id", flat=True)) == (
        {big.pk} if one_size else {big.pk, small.pk}
    )


def test_an_agents_inventory_keeps_an_admins_pin(db: Any, sent_tasks: Any) -> None:
    gpus = [g.to_json() for g in SimulatedBackend("h", parse_sim_spec("A100-80GB:2")).list_gpus()]
    do_sync_inventory("h", "simulated", "process", gpus)
    first, second = Gpu.objects.order_by("index")
    assert (first.sharing_mode, second.sharing_mode) == (GpuMode.AUTO, GpuMode.AUTO)
    do_set_gpu_mode(first.uuid, GpuMode.DEDICATED)
    do_sync_inventory("h", "simulated", "process", gpus)
    first.refresh_from_db()
    assert first.sharing_mode == GpuMode.DEDICATED
    gpus[1]["mig_enabled"] = True  # reset into MIG mode on the host
    do_sync_inventory("h", "simulated", "process", gpus)
    second.refresh_from_db()
    assert second.sharing_mode == GpuMode.MIG
    gpus[1]["mig_enabled"] = False  # and out of it: it follows demand
    do_sync_inventory("h", "simulated", "process", gpus)
    second.refresh_from_db()
    assert second.sharing_mode == GpuMode.AUTO


@pytest.mark.django_db(transaction=True)  # migrations run outside a transaction
def test_the_migration_keeps_what_an_admin_chose_and_lets_defaults_follow_demand(db: Any) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate([("fleet", "0003_fleet_plans")])
    old = executor.loader.project_state([("fleet", "0003_fleet_plans")]).apps
    host = old.get_model("fleet", "Host").objects.create(name="old", backend="nvml")
    gpu = old.get_model("fleet", "Gpu")
    made = {
        name: gpu.objects.create(host=host, index=i, uuid=f"GPU-{name}", name="A100", memory_mib=81920,
                                 sharing_mode=mode, mig_enabled=mode == "mig")
        for i, (name, mode) in enumerate(
            [("default", "dedicated"), ("chosen", "dedicated"), ("mps", "mps"), ("slice", "timeslice"),
             ("mig", "mig")]
        )
    }  # fmt: skip
    AuditEntry.objects.create(
        actor_name="ada", action="changed", target_type="fleet.gpu", target_id=str(made["chosen"].pk),
        target_repr="old/gpu1", before={"sharing_mode": "mps"}, after={"sharing_mode": "dedicated"},
    )  # fmt: skip
    MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    modes = dict(Gpu.objects.filter(host__name="old").values_list("uuid", "sharing_mode"))
    assert modes == {
        "GPU-default": "auto",  # the inventory's old default: it follows demand now
        "GPU-chosen": "dedicated",  # an admin chose it: still pinned
        "GPU-mps": "mps",
        "GPU-slice": "timeslice",
        "GPU-mig": "mig",
    }


def test_a_shares_launch_says_whether_its_gpu_is_pinned_to_mps(
    people: Any, catalog: Any, auto_fleet: Any, sent_tasks: Any
) -> None:
    """The agent keeps a GPU's MPS daemon between shares only where it is pinned to MPS."""
    from portal.sandboxes.specs import launch_spec

    following = _ask(people, catalog, "mps", mps_memory_mib=4096, mps_thread_pct=10)
    place_all()
    gpu = following.allocations.get().gpu
    do_set_gpu_mode(gpu.uuid, GpuMode.MPS)
    pinned = _ask(people, catalog, "mps", mps_memory_mib=4096, mps_thread_pct=10)
    place_all()
    assert pinned.allocations.get().gpu == gpu  # packed beside the first
    do_set_gpu_mode(gpu.uuid, GpuMode.AUTO)
    assert not launch_spec(Sandbox.objects.get(pk=following.pk)).mps_pinned
    do_set_gpu_mode(gpu.uuid, GpuMode.MPS)
    spec = launch_spec(Sandbox.objects.get(pk=pinned.pk))
    assert spec.mps_pinned and spec.mps is not None and spec.device_uuids == (gpu.uuid,)
