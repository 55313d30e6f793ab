"""Fleet plans carried out: MIG re-layouts and shared-GPU consolidation, end to end.

The control worker's tasks and a real ``Agent`` on the simulated GPU backend run in this
process; ``pump`` delivers every message one sends to the other, in order, as Celery would.
Only the sandbox driver is an in-memory stand-in (the real drivers have their own tests).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.control.plans import (
    PlanError,
    auto_relayout,
    do_plan_report,
    do_start_consolidation,
    do_start_mig_plan,
    mig_fleet,
)
from portal.control.reconcile import do_reconcile_host
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import FleetPlan, Gpu, Host, MigInstance
from portal.sandboxes import actions, nudge
from portal.sandboxes.models import Allocation, Sandbox
from portal.scheduling.snapshot import build_snapshot
from scheduler.cluster import DeviceGrant
from scheduler.defrag import MigPlan, apply_mig_plan
from scheduler.gpus import CATALOG, check_layout
from tests.portal.helpers import client_for, request
from wire.spec import SandboxHandle, SandboxSpec
from workers.drivers.base import SandboxStatus
from workers.gpu.simulated import SimulatedBackend, SimulatedGpuConfig, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


class MemoryDriver:
    """Sandboxes as dictionary entries: launch, stop, status and list, nothing else."""

    name = "memory"
    storage_dir = None  # mounts no storage

    def __init__(self) -> None:
        self.live: dict[str, SandboxHandle] = {}
        self.stopped: list[str] = []

    def prepare(self, spec: SandboxSpec, report: Any) -> None:
        pass

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        handle = self.live.get(spec.allocation_key)
        if handle is None:
            handle = SandboxHandle(
                self.name, spec.allocation_key, spec.sandbox_id, f"m-{spec.allocation_key[:8]}"
            )
            self.live[spec.allocation_key] = handle
        return handle

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        if self.live.pop(handle.allocation_key, None) is not None:
            self.stopped.append(handle.allocation_key)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        state = "running" if handle.allocation_key in self.live else "missing"
        return SandboxStatus(state=state, started_at_ms=int(time.time() * 1000))

    def list_owned(self) -> list[SandboxHandle]:
        return list(self.live.values())


def pump(sent: list[Any], agents: dict[str, Agent]) -> None:
    """Deliver the captured messages (and those they cause) until none is left."""
    from workers import control

    while sent:
        queue, task, args = sent.pop(0)
        if queue == "control":
            control.TASKS[task](*args)
            continue
        agent = agents[queue.removeprefix("host.")]
        if task == "launch_sandbox":
            agent.launch(SandboxSpec.from_json(args[0]))
        elif task == "stop_sandbox":
            agent.stop(args[0], args[2])
        elif task == "execute_plan":
            agent.execute_plan(*args)
        elif task == "report_inventory":
            agent.report_inventory()
        else:
            raise AssertionError(f"unexpected agent task {task}")


def simulated_host(name: str, configs: list[SimulatedGpuConfig], tmp_path: Path) -> Agent:
    # The MPS daemons (simulated: marker files that outlive an agent, as a daemon's pid file
    # does) under the test's own directory, not a root agent's /run/gpushare.
    settings = AgentSettings(host=name, mps_dir=str(tmp_path / "mps"))
    agent = Agent(name, SimulatedBackend(name, configs), MemoryDriver(), tmp_path / name, settings)  # type: ignore[arg-type]
    do_sync_inventory(
        name, "simulated", "memory", agent.context.inventory.refresh(), agent.context.inventory.facts()
    )
    return agent


def instance(host: str, gpu_index: int, profile: str, start: int) -> MigInstance:
    return MigInstance.objects.get(gpu__host__name=host, gpu__index=gpu_index, profile=profile, start=start)


def run_on(
    people: Any, catalog: Any, sent: list[Any], agents: dict[str, Agent], grant: DeviceGrant
) -> Sandbox:
    """A running sandbox on exactly ``grant`` (placed by hand, not by the scheduler)."""
    tier = catalog[grant.kind]
    kw: dict[str, Any] = {}
    if grant.kind == "mig":
        kw["mig_profile"] = MigInstance.objects.get(uuid=grant.mig_uuid).profile
    if grant.kind == "mps":
        kw.update(mps_memory_mib=grant.mps_memory_mib, mps_thread_pct=grant.mps_thread_pct)
    sandbox = request(people["owner"], people["project"], tier, catalog["image"], **kw)
    sent.clear()  # the cycle asked for: this sandbox is placed by hand instead
    nudge.cycle_begins()  # as that cycle would have, so later changes ask again
    host = Gpu.objects.get(uuid=grant.gpu_uuid).host.name
    assert actions.do_place(sandbox.pk, host, (grant,))
    pump(sent, agents)
    sandbox.refresh_from_db()
    assert sandbox.state == "running", sandbox.state
    return sandbox


def mig_grant(m: MigInstance) -> DeviceGrant:
    return DeviceGrant(gpu_uuid=m.gpu.uuid, device_uuid=m.uuid, kind="mig", milli_gpu=143, mig_uuid=m.uuid)


def layouts(agent: Agent) -> dict[str, list[tuple[str, int]]]:
    return {
        g.uuid: sorted((m.profile, m.start) for m in g.mig_devices) for g in agent.context.backend.list_gpus()
    }


@pytest.fixture
def mig_host(tmp_path: Path) -> Agent:
    """GPU 0: 1g@0-3 and 3g@4; GPU 1: 3g@0 and 1g@4-6 (H100, every slice in use)."""
    ones = lambda starts: tuple(("1g.10gb", s) for s in starts)  # noqa: E731
    return simulated_host(
        "mig1",
        [
            SimulatedGpuConfig("H100-80GB", mig=True, mig_layout=(*ones(range(4)), ("3g.40gb", 4))),
            SimulatedGpuConfig("H100-80GB", mig=True, mig_layout=(("3g.40gb", 0), *ones(range(4, 7)))),
        ],
        tmp_path,
    )


def test_a_mig_relayout_runs_on_the_simulated_backend_and_matches_its_plan(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent
) -> None:
    agents = {"mig1": mig_host}
    a = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    b = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    c = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "1g.10gb", 4)))
    c_key = c.allocation_key
    wanting = request(
        people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="4g.40gb"
    )
    pump(sent_tasks, agents)
    wanting.refresh_from_db()
    assert wanting.state == "queued"  # no 4g instance anywhere
    before, _ = mig_fleet(Host.objects.get(name="mig1"))

    plan = do_start_mig_plan("mig1", "4g.40gb", max_disturbed=7, actor=people["admin"])
    planned = MigPlan.from_json(plan.plan)
    assert planned.disturbed and set(planned.disturbed) <= {str(a.pk), str(b.pk)}
    assert str(c.pk) not in planned.disturbed
    # While it runs, the GPUs it changes take no placements.
    assert not any(g.available for h in build_snapshot().hosts for g in h.gpus if g.uuid in plan.touched_gpus)
    pump(sent_tasks, agents)

    plan.refresh_from_db()
    assert plan.state == "done", plan.error
    expected = {g.uuid: sorted(g.layout()) for g in apply_mig_plan(before, planned)}
    assert layouts(mig_host) == expected  # the backend holds exactly the planned layout
    for gpu in mig_host.context.backend.list_gpus():
        assert check_layout(CATALOG[gpu.model], [(m.profile, m.start) for m in gpu.mig_devices]) == []
        in_db = sorted(MigInstance.objects.filter(gpu__uuid=gpu.uuid).values_list("profile", "start"))
        assert in_db == expected[gpu.uuid]
    # Each moved sandbox runs again on the slot the plan gave it, billed in two intervals.
    placed_by_plan = {
        i.sandbox: (g.uuid, i.profile, i.start) for g in apply_mig_plan(before, planned) for i in g.instances
    }
    for moved in (a, b):
        moved.refresh_from_db()
        assert moved.state == "running" and moved.moving_plan is None
        if str(moved.pk) in planned.disturbed:
            alloc = moved.allocations.get(active=True)
            assert alloc.mig_instance is not None
            gpu_uuid, profile, start = placed_by_plan[str(moved.pk)]
            assert (alloc.gpu.uuid, alloc.mig_instance.profile, alloc.mig_instance.start) == (
                gpu_uuid,
                profile,
                start,
            )
            records = UsageRecord.objects.filter(sandbox=moved).order_by("started_at")
            assert len(records) == 2 and records[0].ended_at is not None and records[1].ended_at is None
    c.refresh_from_db()
    assert (c.state, c.allocation_key) == ("running", c_key)  # not disturbed at all
    # The request it was made for lands on the new instance.
    wanting.refresh_from_db()
    assert wanting.state == "running"
    target = wanting.allocations.get(active=True)
    assert (target.gpu.uuid, target.mig_instance.start) == (planned.gpu, planned.start)  # type: ignore[union-attr]
    actions_taken = Counter(plan.steps.values_list("action", flat=True))
    assert actions_taken["planned"] == 1 and actions_taken["done"] == 1
    assert actions_taken["stop"] == actions_taken["relaunch"] == len(planned.disturbed)
    assert actions_taken["destroy"] >= 1 and actions_taken["create"] >= 1


def test_a_failing_checkpoint_hook_calls_the_relayout_off(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent, tmp_path: Path, monkeypatch: Any
) -> None:
    agents = {"mig1": mig_host}
    a = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    b = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    hook = tmp_path / "hook"
    hook.write_text('#!/bin/sh\necho "cannot save job $GPUSHARE_SANDBOX_ID" >&2\nexit 3\n')
    hook.chmod(0o755)
    mig_host.context.settings = replace(mig_host.context.settings, checkpoint_hook=str(hook))
    layout_before = layouts(mig_host)

    plan = do_start_mig_plan("mig1", "4g.40gb", max_disturbed=7)
    pump(sent_tasks, agents)

    plan.refresh_from_db()
    assert plan.state == "failed" and "called off" in plan.error
    assert layouts(mig_host) == layout_before  # nothing destroyed, nothing made
    for sandbox in (a, b):
        key = sandbox.allocation_key
        sandbox.refresh_from_db()
        assert (sandbox.state, sandbox.allocation_key, sandbox.moving_plan) == ("running", key, None)
    [checkpoint] = plan.steps.filter(action="checkpoint")
    assert not checkpoint.ok and "exited with 3: cannot save job" in checkpoint.message
    assert plan.steps.filter(action="left", ok=False).exists()


def test_a_checkpoint_hook_runs_before_the_stop(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent, tmp_path: Path, monkeypatch: Any
) -> None:
    agents = {"mig1": mig_host}
    a = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    seen = tmp_path / "seen"
    hook = tmp_path / "hook"
    hook.write_text(f'#!/bin/sh\necho "$1 $GPUSHARE_SANDBOX_ID $GPUSHARE_PLAN_ID" >> {seen}\necho saved\n')
    hook.chmod(0o755)
    mig_host.context.settings = replace(mig_host.context.settings, checkpoint_hook=str(hook))
    plan = do_start_mig_plan("mig1", "4g.40gb", max_disturbed=7)
    pump(sent_tasks, agents)
    plan.refresh_from_db()
    assert plan.state == "done"
    disturbed = MigPlan.from_json(plan.plan).disturbed
    assert sorted(seen.read_text().split("\n")[:-1]) == sorted(f"checkpoint {s} {plan.pk}" for s in disturbed)
    assert all(s.ok and "saved" in s.message for s in plan.steps.filter(action="checkpoint"))
    a.refresh_from_db()
    assert a.state == "running"


def test_a_relayout_is_refused_while_a_sandbox_it_would_move_is_not_running(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent
) -> None:
    agents = {"mig1": mig_host}
    a = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    b = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    for sandbox in (a, b):  # stopping: their devices are held until the stop is confirmed
        actions.do_request_stop(sandbox.pk, people["owner"])
    with pytest.raises(PlanError, match="not running"):
        do_start_mig_plan("mig1", "4g.40gb", max_disturbed=7)
    assert not FleetPlan.objects.exists()
    with pytest.raises(PlanError, match="disturbs at most 0"):
        do_start_mig_plan("mig1", "7g.80gb", max_disturbed=0)


def test_owner_stop_during_a_move_ends_the_sandbox_and_reconcile_leaves_movers_alone(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent
) -> None:
    agents = {"mig1": mig_host}
    a = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    b = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    plan = do_start_mig_plan("mig1", "4g.40gb", max_disturbed=7)
    [execute] = [m for m in sent_tasks if m[1] == "execute_plan"]
    sent_tasks.clear()
    # The agent stops them first; a heartbeat's report in between must not "repair" that.
    mig_host.execute_plan(*execute[2])
    report = [m for m in sent_tasks if m[1] == "plan_executed"]
    sent_tasks.clear()
    owned = mig_host.reports.owned(mig_host.context.driver.list_owned())
    repairs = do_reconcile_host("mig1", timezone.now(), owned)
    assert not repairs
    moved = [s for s in (a, b) if str(s.pk) in MigPlan.from_json(plan.plan).disturbed]
    actions.do_request_stop(moved[0].pk, people["owner"])
    sent_tasks.clear()
    do_plan_report(*report[0][2])
    do_plan_report(*report[0][2])  # delivered twice: nothing more happens
    moved[0].refresh_from_db()
    assert moved[0].state == "stopped"
    assert not Allocation.objects.filter(sandbox=moved[0], active=True).exists()


def test_the_tick_reshapes_idle_mig_instances_for_a_waiting_request(
    people: Any, catalog: Any, sent_tasks: Any, tmp_path: Path, settings: Any
) -> None:
    agent = simulated_host("mig2", parse_sim_spec("H100-80GB:1:mig=0"), tmp_path)  # 3g@4 2g@0 1g@2 1g@3
    agents = {"mig2": agent}
    busy = run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig2", 0, "3g.40gb", 4)))
    wanting = request(
        people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="1g.20gb"
    )
    pump(sent_tasks, agents)
    assert Sandbox.objects.get(pk=wanting.pk).state == "queued"
    settings.MIG_AUTO_RELAYOUT_MAX_DISTURBED = 0
    plan = auto_relayout()
    assert plan is not None and plan.created_by is None and "queued 1g.20gb" in plan.purpose
    pump(sent_tasks, agents)
    plan.refresh_from_db()
    wanting.refresh_from_db()
    busy_key = busy.allocation_key
    busy.refresh_from_db()
    assert plan.state == "done" and wanting.state == "running"
    assert (busy.state, busy.allocation_key) == ("running", busy_key)  # idle instances only
    assert auto_relayout() is None  # nothing waits any more
    settings.MIG_AUTO_RELAYOUT_MAX_DISTURBED = -1
    request(people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="7g.80gb")
    assert auto_relayout() is None  # switched off


def test_consolidation_moves_mps_shares_and_frees_a_gpu(
    people: Any, catalog: Any, sent_tasks: Any, tmp_path: Path
) -> None:
    agents = {
        "mps1": simulated_host("mps1", parse_sim_spec("H100-80GB:2"), tmp_path),
        "mps2": simulated_host("mps2", parse_sim_spec("H100-80GB:1"), tmp_path),
    }
    Gpu.objects.update(sharing_mode="mps")
    gpu = {(g.host.name, g.index): g for g in Gpu.objects.select_related("host")}

    def share(host: str, index: int, threads: int) -> DeviceGrant:
        g = gpu[(host, index)]
        return DeviceGrant(
            gpu_uuid=g.uuid, device_uuid=g.uuid, kind="mps", milli_gpu=threads * 10,
            mps_memory_mib=8192, mps_thread_pct=threads,
        )  # fmt: skip

    lonely = run_on(people, catalog, sent_tasks, agents, share("mps1", 0, 20))
    run_on(people, catalog, sent_tasks, agents, share("mps1", 1, 40))
    run_on(people, catalog, sent_tasks, agents, share("mps2", 0, 30))
    run_on(people, catalog, sent_tasks, agents, share("mps2", 0, 30))

    plan = do_start_consolidation(actor=people["admin"])
    [migration] = plan.plan["migrations"]
    assert migration["sandbox"] == str(lonely.pk) and plan.plan["frees"] == [gpu[("mps1", 0)].uuid]
    pump(sent_tasks, agents)

    plan.refresh_from_db()
    lonely.refresh_from_db()
    assert plan.state == "done" and lonely.state == "running"
    alloc = lonely.allocations.get(active=True)
    assert alloc.gpu.uuid == migration["to_gpu"] and (alloc.mps_thread_pct, alloc.mps_memory_mib) == (
        20,
        8192,
    )
    assert lonely.host is not None and lonely.host.name == migration["to_host"]
    assert not Allocation.objects.filter(gpu=gpu[("mps1", 0)], active=True).exists()  # a whole GPU free
    with pytest.raises(PlanError, match="nothing to consolidate"):
        do_start_consolidation()


def test_the_plans_console_is_for_admins_and_says_what_is_wrong(
    people: Any, catalog: Any, sent_tasks: Any, mig_host: Agent
) -> None:
    agents = {"mig1": mig_host}
    run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 0, "1g.10gb", 1)))
    run_on(people, catalog, sent_tasks, agents, mig_grant(instance("mig1", 1, "3g.40gb", 0)))
    owner, admin = client_for(people["owner"]), client_for(people["admin"])
    assert owner.get("/console/plans/").status_code == 302
    assert owner.post("/console/plans/mig/", {"host": "mig1", "profile": "4g.40gb"}).status_code == 302
    assert not FleetPlan.objects.exists()

    bad = admin.post("/console/plans/mig/", {"host": "nowhere", "profile": "5g.50gb", "max_disturbed": "9"})
    assert bad.status_code == 400
    assert set(bad.context["mig_form"].errors) == {"host", "profile", "max_disturbed"}
    refused = admin.post("/console/plans/mig/", {"host": "mig1", "profile": "4g.40gb", "max_disturbed": "0"})
    assert refused.status_code == 400 and b"disturbs at most 0 running sandbox" in refused.content
    nothing = admin.post("/console/plans/consolidate/", {})
    assert nothing.status_code == 400 and b"nothing to consolidate" in nothing.content

    ask = {"host": "mig1", "profile": "4g.40gb", "max_disturbed": "1"}
    preview = admin.post("/console/plans/mig/", {**ask, "action": "preview"})
    assert preview.status_code == 200 and not FleetPlan.objects.exists()  # nothing runs yet
    shown = preview.context["preview"]
    assert shown.disturbed and shown.steps[-1].startswith("create 4g.40gb@0 on GPU")
    assert b"Approve and run" in preview.content and b"olivia, project vision" in preview.content
    stale = admin.post("/console/plans/mig/", {**ask, "action": "run", "fingerprint": "0" * 16})
    assert stale.status_code == 400 and b"this is not the plan previewed" in stale.content
    started = admin.post("/console/plans/mig/", {**ask, "action": "run", "fingerprint": shown.fingerprint})
    assert started.status_code == 302
    assert b'hx-trigger="every 2s"' in admin.get("/console/plans/").content  # watched while it runs
    pump(sent_tasks, agents)
    page = admin.get("/console/plans/")
    assert b'hx-trigger="every 2s"' not in page.content
    plan = FleetPlan.objects.get()
    assert plan.state == "done" and plan.created_by == people["admin"]
    assert (
        page.status_code == 200
        and b"make room for 4g.40gb on mig1" in page.content
        and b"relaunching" in page.content
    )
