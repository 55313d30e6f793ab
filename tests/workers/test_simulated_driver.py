"""The state-only driver of simulated hosts at a cluster's size: it records sandboxes,
runs nothing, keeps its record across an agent's restart, and is refused on real GPUs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from wire.spec import DRIVER_ISOLATION, SandboxSpec
from workers import selftest
from workers.agent import refuse_state_only_on_real_gpus
from workers.drivers import DriverUnavailable, make_driver
from workers.drivers.base import DriverError
from workers.drivers.simulated import SimulatedDriver


def spec(allocation: str, sandbox: int) -> SandboxSpec:
    return SandboxSpec(
        allocation_key=allocation, sandbox_id=sandbox, host="twin-1", project="p", owner="o",
        image="busybox", command=("sleep", "infinity"), device_uuids=("GPU-1",), real_gpu=False,
    )  # fmt: skip


def test_a_launch_is_recorded_once_and_a_stop_forgets_it(tmp_path: Path) -> None:
    driver = make_driver("simulated", "twin-1", tmp_path)
    assert isinstance(driver, SimulatedDriver) and DRIVER_ISOLATION[driver.name] == "container"
    first = driver.launch(spec("a1", 1))
    assert driver.launch(spec("a1", 1)) == first  # idempotent, keyed by the allocation
    driver.launch(spec("a2", 2))
    assert {h.allocation_key for h in driver.list_owned()} == {"a1", "a2"}
    status = driver.status(first)
    assert status.state == "running" and status.started_at_ms is not None
    driver.stop(first)
    driver.stop(first)  # a repeated stop is harmless
    assert driver.status(first).state == "missing"
    assert [h.allocation_key for h in driver.list_owned()] == ["a2"]


def test_a_restarted_agent_still_owns_its_sandboxes(tmp_path: Path) -> None:
    before = SimulatedDriver(tmp_path, "twin-1")
    kept = before.launch(spec("a1", 1))
    before.launch(spec("a2", 2))
    before.stop(before.launch(spec("a2", 2)))
    after = SimulatedDriver(tmp_path, "twin-1")
    assert after.list_owned() == [kept]
    assert after.status(kept) == before.status(kept)


def test_a_damaged_state_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "simulated-sandboxes.json").write_text("{not json")
    with pytest.raises(DriverError, match="unreadable simulated sandbox state"):
        SimulatedDriver(tmp_path, "twin-1")


def test_nothing_runs_so_no_terminal_and_no_output(tmp_path: Path) -> None:
    driver = SimulatedDriver(tmp_path, "twin-1")
    handle = driver.launch(spec("a1", 7))
    with pytest.raises(DriverError, match="sandbox 7 is simulated"):
        driver.exec_terminal(handle)
    chunk = driver.read_output(handle, 0, 1024)
    assert chunk.data == b"" and chunk.total == 0


def test_the_agents_self_test_passes_and_leaves_nothing(tmp_path: Path) -> None:
    result = selftest.run("simulated", "twin-1", tmp_path)
    assert result.ok, result.describe()
    assert SimulatedDriver(tmp_path, "twin-1").list_owned() == []


def test_an_agent_with_real_gpus_refuses_the_state_only_driver(tmp_path: Path) -> None:
    driver = make_driver("simulated", "gpu-1", tmp_path)
    refuse_state_only_on_real_gpus(SimpleNamespace(simulated=True, name="simulated"), driver)
    with pytest.raises(DriverUnavailable) as refused:
        refuse_state_only_on_real_gpus(SimpleNamespace(simulated=False, name="nvml"), driver)
    assert "GPUs are real (nvml)" in refused.value.reason and "SANDBOX_DRIVER" in refused.value.remedy
