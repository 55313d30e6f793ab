"""What the agent does with the GPU conditions NVML raises no event for (issue 36, review 3
new #4 and #9): a GPU whose NVLink fabric Fabric Manager has not registered is reported not
ready (and ready again) through the inventory, re-checked every heartbeat; a board's failed
or pending memory repair is read at start and every GPU_MEMORY_CHECK_S, and drains the GPU
like an XID. On the simulated backend, whose conditions the tests set as NVML reports them
(the NVML reading itself: test_nvml_board.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.drivers.process import ProcessDriver
from workers.gpu.base import MemoryRepairs
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings

FABRIC_WAIT = (
    "NVLink fabric not ready: Fabric Manager has not registered this GPU (state in progress); "
    "CUDA fails with error 802 on it until then"
)


def host(tmp_path: Path, **settings: Any) -> tuple[Agent, SimulatedBackend]:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:2"))
    agent = Agent(
        "h",
        backend,
        ProcessDriver(tmp_path / "sandboxes", host="h"),
        tmp_path,
        AgentSettings(host="h", **settings),
    )
    agent.context.inventory.refresh()
    return agent, backend


def inventories(sent_tasks: Any) -> list[dict[str, str]]:
    """Each inventory sent: GPU uuid -> its not_ready."""
    return [
        {g["uuid"]: g["not_ready"] for g in report["gpus"]}
        for t in sent_tasks
        if t[1] == "agent_inventories"
        for report in t[2][0]
    ]


def drains(sent_tasks: Any) -> list[tuple[str, str, str]]:
    return [(e["uuid"], e["kind"], e["detail"]) for t in sent_tasks if t[1] == "gpu_faults" for e in t[2][1]]


def report_faults(agent: Agent) -> list[Any]:
    context = agent.context
    return agent.faults.report(context.sandboxes.specs(), [], context.inventory.parent_of())


# -- fabric ------------------------------------------------------------------------------------


def test_a_gpu_whose_fabric_is_not_ready_goes_to_the_portal_with_the_reason_and_comes_back(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path)
    first, second = (g.uuid for g in agent.context.inventory.gpus)
    backend.set_fabric_problem(first, FABRIC_WAIT)
    agent.announce()  # the agent starts while Fabric Manager is still registering it
    assert inventories(sent_tasks) == [{first: FABRIC_WAIT, second: ""}]

    agent.reports.heartbeat()  # nothing changed: no inventory
    assert len(inventories(sent_tasks)) == 1

    backend.set_fabric_problem(first, "")  # registered: the next heartbeat says so
    agent.reports.heartbeat()
    assert inventories(sent_tasks)[-1] == {first: "", second: ""}
    agent.reports.heartbeat()
    assert len(inventories(sent_tasks)) == 2


def test_a_fabric_that_fails_while_the_agent_runs_takes_the_gpu_out_at_the_next_heartbeat(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path)
    first = agent.context.inventory.gpus[0].uuid
    agent.announce()
    backend.set_fabric_problem(first, FABRIC_WAIT)  # e.g. nvidia-fabricmanager stopped
    assert agent.context.inventory.recheck_fabric()
    assert inventories(sent_tasks)[-1][first] == FABRIC_WAIT
    assert not agent.context.inventory.recheck_fabric()


# -- memory repairs ------------------------------------------------------------------------------


def test_a_failed_row_remap_from_before_the_agent_started_drains_at_its_first_report(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path)
    gpu = agent.context.inventory.gpus[1].uuid
    backend.set_memory_repairs(gpu, MemoryRepairs(0, 3, remap_failed=True))
    changes = report_faults(agent)
    [(uuid, kind, detail)] = drains(sent_tasks)
    assert (uuid, kind) == (gpu, "remap_failed")
    assert "the GPU needs replacement (RMA)" in detail
    assert [(c["kind"], c["gpu"], c["sandbox"]) for c in changes] == [("ecc", gpu, None)]
    assert "needs replacement" in changes[0]["message"]


def test_a_pending_row_remap_drains_for_a_reset(tmp_path: Path, sent_tasks: Any) -> None:
    agent, backend = host(tmp_path)
    gpu = agent.context.inventory.gpus[0].uuid
    backend.set_memory_repairs(gpu, MemoryRepairs(0, 1, remap_pending=True))
    report_faults(agent)
    assert [(u, k) for u, k, _ in drains(sent_tasks)] == [(gpu, "remap_pending")]
    assert drains(sent_tasks)[0][2].startswith("reset the GPU when idle")


def test_pages_pending_retirement_drain_for_a_reset(tmp_path: Path, sent_tasks: Any) -> None:
    agent, backend = host(tmp_path)
    gpu = agent.context.inventory.gpus[0].uuid
    backend.set_memory_repairs(gpu, MemoryRepairs(retired_pages_dbe=1, retirement_pending=True))
    report_faults(agent)
    assert [(u, k) for u, k, _ in drains(sent_tasks)] == [(gpu, "retirement_pending")]


def test_clean_gpus_are_left_alone(tmp_path: Path, sent_tasks: Any) -> None:
    agent, _ = host(tmp_path)
    assert report_faults(agent) == []
    assert drains(sent_tasks) == []


def test_the_periodic_read_notices_a_new_failure_and_reports_each_condition_once(
    tmp_path: Path, sent_tasks: Any
) -> None:
    agent, backend = host(tmp_path, memory_check_s=600.0)
    now = [1000.0]
    agent.faults.memory._clock = lambda: now[0]
    gpu = agent.context.inventory.gpus[0].uuid
    report_faults(agent)  # the read at start: clean
    backend.set_memory_repairs(gpu, MemoryRepairs(0, 9, remap_failed=True))
    now[0] += 599
    report_faults(agent)  # not due yet: not read
    assert drains(sent_tasks) == []
    now[0] += 1
    report_faults(agent)
    assert [(u, k) for u, k, _ in drains(sent_tasks)] == [(gpu, "remap_failed")]
    now[0] += 600
    report_faults(agent)  # still failed: reported once (an admin's undrain is not overruled)
    assert len(drains(sent_tasks)) == 1
    backend.set_memory_repairs(gpu, MemoryRepairs(0, 9, remap_failed=True, remap_pending=True))
    now[0] += 600
    report_faults(agent)  # a new condition on the same board is
    assert [k for _, k, _ in drains(sent_tasks)] == ["remap_failed", "remap_pending"]


def test_the_memory_check_period_is_a_setting(monkeypatch: Any) -> None:
    monkeypatch.setenv("GPUSHARE_HOST", "h")
    assert AgentSettings.from_env().memory_check_s == 600.0
    monkeypatch.setenv("GPU_MEMORY_CHECK_S", "120")
    assert AgentSettings.from_env().memory_check_s == 120.0
