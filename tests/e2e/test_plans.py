"""A MIG re-layout through the running platform: the Celery control worker plans nothing on
its own here (no free instance can be made without moving a sandbox), an admin starts the
plan, and the real agent stops a bubblewrap sandbox, reshapes its simulated GPU and gets it
relaunched on its new instance, which the waiting request then finds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from portal.fleet.models import FleetPlan, Gpu, MigInstance
from portal.fleet.plans import do_start_mig_plan
from portal.sandboxes.models import Sandbox
from scheduler.defrag import MigPlan
from scheduler.gpus import CATALOG, check_layout
from tests.e2e.platform import running_platform, wait_for
from tests.e2e.test_loop import ask, descendants, state_of
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def visible_devices(sandbox: Sandbox) -> set[str]:
    assert sandbox.handle is not None
    found = set()
    for pid in descendants(int(sandbox.handle["ref"])):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"NVIDIA_VISIBLE_DEVICES="):
                found.add(item.split(b"=", 1)[1].decode())
    return found


def test_a_mig_relayout_moves_a_running_sandbox_and_makes_room(
    people: Any, catalog: Any, tmp_path: Path
) -> None:
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    web = Client()
    web.force_login(people["owner"])

    def request(profile: str) -> int:
        return ask(
            web,
            {
                "project": str(people["project"].pk),
                "image": str(catalog["image"].pk),
                "isolation": "process",
                "duration_hours": "1",
                "tier": str(catalog["mig"].pk),
                "mig_profile": profile,
            },
        )

    # Two H100s in MIG mode, each 3g@4 2g@0 1g@2 1g@3: one 2g sandbox on each blocks every 4g.
    with running_platform(tmp_path, driver="process", sim_gpus="H100-80GB:2:mig=0,1") as platform:
        first, second = request("2g.20gb"), request("2g.20gb")
        wait_for(lambda: {state_of(first), state_of(second)} == {"running"}, 60, "both 2g sandboxes to run")
        wanting = request("4g.40gb")
        wait_for(lambda: Sandbox.objects.get(pk=wanting).pending_reason, 30, "the 4g request to wait")
        assert state_of(wanting) == "queued"
        before = {pk: Sandbox.objects.get(pk=pk) for pk in (first, second)}

        plan = do_start_mig_plan(platform.host, "4g.40gb", max_disturbed=1, actor=people["admin"])
        planned = MigPlan.from_json(plan.plan)
        [moved_id] = [int(s) for s in planned.disturbed]
        wait_for(lambda: FleetPlan.objects.get(pk=plan.pk).state != "running", 60, "the plan to finish")
        plan.refresh_from_db()
        assert plan.state == "done", plan.error
        wait_for(lambda: state_of(moved_id) == "running", 60, "the moved sandbox to run again")
        wait_for(lambda: state_of(wanting) == "running", 60, "the 4g request to run")

        moved = Sandbox.objects.get(pk=moved_id)
        alloc = moved.allocations.get(active=True)
        assert alloc.mig_instance is not None and alloc.mig_instance.profile == "2g.20gb"
        assert moved.allocation_key != before[moved_id].allocation_key
        assert visible_devices(moved) == {alloc.device_uuid}  # the new instance, in its environment
        old_handle, new_handle = before[moved_id].handle, moved.handle
        assert old_handle is not None and new_handle is not None
        assert new_handle["ref"] != old_handle["ref"]  # a new process
        target = Sandbox.objects.get(pk=wanting).allocations.get(active=True)
        assert (target.gpu.uuid, target.mig_instance.start) == (planned.gpu, planned.start)  # type: ignore[union-attr]
        untouched = Sandbox.objects.get(pk=({first, second} - {moved_id}).pop())
        other = before[untouched.pk]
        assert (untouched.state, untouched.allocation_key) == ("running", other.allocation_key)
        for gpu in Gpu.objects.filter(host__name=platform.host):
            layout = list(MigInstance.objects.filter(gpu=gpu).values_list("profile", "start"))
            assert check_layout(CATALOG[gpu.model], layout) == []
        steps = list(plan.steps.values_list("action", flat=True))
        assert steps[0] == "planned" and steps[-1] == "done" and "stop" in steps and "relaunch" in steps
