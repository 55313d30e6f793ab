"""A MIG re-layout through the running platform: the Celery control worker plans nothing on
its own here (no free instance can be made without moving a sandbox), an admin starts the
plan, and the real agent stops a bubblewrap sandbox, reshapes its simulated GPU and gets it
relaunched on its new instance, which the waiting request then finds. One platform for the
scenario's steps (a class marked ``steps``): a failure names the step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from portal.control.plans import do_start_mig_plan
from portal.fleet.models import FleetPlan, Gpu, MigInstance
from portal.sandboxes.models import Sandbox
from scheduler.defrag import MigPlan
from scheduler.gpus import CATALOG, check_layout
from tests.e2e.platform import Platform, running_platform, wait_for
from tests.e2e.test_loop import ask, descendants, state_of
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.slow]


def visible_devices(sandbox: Sandbox) -> set[str]:
    assert sandbox.handle is not None
    found = set()
    for pid in descendants(int(sandbox.handle["ref"])):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"NVIDIA_VISIBLE_DEVICES="):
                found.add(item.split(b"=", 1)[1].decode())
    return found


@pytest.fixture(scope="class")
def platform(world: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    # Two H100s in MIG mode, each 3g@4 2g@0 1g@2 1g@3: one 2g sandbox on each blocks every 4g.
    with running_platform(
        tmp_path_factory.mktemp("plans"), driver="process", sim_gpus="H100-80GB:2:mig=0,1"
    ) as platform:
        yield platform


@pytest.fixture(scope="class")
def request_mig(world: dict[str, Any]) -> Any:
    web = Client()
    web.force_login(world["owner"])

    def request(profile: str) -> int:
        return ask(
            web,
            {
                "project": str(world["project"].pk),
                "image": str(world["image"].pk),
                "isolation": "process",
                "duration_hours": "1",
                "tier": str(world["mig"].pk),
                "mig_profile": profile,
            },
        )

    return request


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestAMigRelayoutMovesARunningSandboxAndMakesRoom:
    def test_01_two_2g_sandboxes_run(
        self, platform: Platform, request_mig: Any, state: dict[str, Any]
    ) -> None:
        first, second = request_mig("2g.20gb"), request_mig("2g.20gb")
        wait_for(lambda: {state_of(first), state_of(second)} == {"running"}, 60, "both 2g sandboxes to run")
        state["first"], state["second"] = first, second
        state["before"] = {pk: Sandbox.objects.get(pk=pk) for pk in (first, second)}

    def test_02_a_4g_request_waits_with_a_reason(self, request_mig: Any, state: dict[str, Any]) -> None:
        wanting = state["wanting"] = request_mig("4g.40gb")
        wait_for(lambda: Sandbox.objects.get(pk=wanting).pending_reason, 30, "the 4g request to wait")
        assert state_of(wanting) == "queued"

    def test_03_the_admins_plan_moves_one_sandbox_and_is_done(
        self, world: dict[str, Any], platform: Platform, state: dict[str, Any]
    ) -> None:
        plan = do_start_mig_plan(platform.host, "4g.40gb", max_disturbed=1, actor=world["admin"])
        state["plan"], state["planned"] = plan, MigPlan.from_json(plan.plan)
        [state["moved"]] = [int(s) for s in state["planned"].disturbed]
        wait_for(lambda: FleetPlan.objects.get(pk=plan.pk).state != "running", 60, "the plan to finish")
        plan.refresh_from_db()
        assert plan.state == "done", plan.error

    def test_04_the_moved_sandbox_runs_again_and_the_4g_request_runs(self, state: dict[str, Any]) -> None:
        moved_id, wanting = state["moved"], state["wanting"]
        wait_for(lambda: state_of(moved_id) == "running", 60, "the moved sandbox to run again")
        wait_for(lambda: state_of(wanting) == "running", 60, "the 4g request to run")

    def test_05_the_moved_sandbox_is_a_new_process_on_a_new_2g_instance(self, state: dict[str, Any]) -> None:
        moved_id, before = state["moved"], state["before"]
        moved = Sandbox.objects.get(pk=moved_id)
        alloc = moved.allocations.get(active=True)
        assert alloc.mig_instance is not None and alloc.mig_instance.profile == "2g.20gb"
        assert moved.allocation_key != before[moved_id].allocation_key
        assert visible_devices(moved) == {alloc.device_uuid}  # the new instance, in its environment
        old_handle, new_handle = before[moved_id].handle, moved.handle
        assert old_handle is not None and new_handle is not None
        assert new_handle["ref"] != old_handle["ref"]  # a new process

    def test_06_the_4g_request_has_the_planned_instance_and_the_other_sandbox_was_left_alone(
        self, state: dict[str, Any]
    ) -> None:
        planned = state["planned"]
        target = Sandbox.objects.get(pk=state["wanting"]).allocations.get(active=True)
        assert (target.gpu.uuid, target.mig_instance.start) == (planned.gpu, planned.start)  # type: ignore[union-attr]
        untouched = Sandbox.objects.get(pk=({state["first"], state["second"]} - {state["moved"]}).pop())
        other = state["before"][untouched.pk]
        assert (untouched.state, untouched.allocation_key) == ("running", other.allocation_key)

    def test_07_every_layout_is_valid_and_the_plan_recorded_its_steps(
        self, platform: Platform, state: dict[str, Any]
    ) -> None:
        for gpu in Gpu.objects.filter(host__name=platform.host):
            layout = list(MigInstance.objects.filter(gpu=gpu).values_list("profile", "start"))
            assert check_layout(CATALOG[gpu.model], layout) == []
        steps = list(state["plan"].steps.values_list("action", flat=True))
        assert steps[0] == "planned" and steps[-1] == "done" and "stop" in steps and "relaunch" in steps
