"""The agent: MPS pipe directories and daemons, GPU memory attributed to sandboxes by pid."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from wire.liveness import OwnedSandbox
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from wire.storage import StorageMount
from workers.drivers.base import SandboxStatus
from workers.gpu.mps import MpsError, device_key, mps_root
from workers.gpu.mps_daemons import MpsDaemons
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings


class RecordingDriver:
    name = "recording"
    storage_dir = None  # mounts no storage

    def __init__(self) -> None:
        self.launched: list[SandboxSpec] = []

    def prepare(self, spec: SandboxSpec, report: Any) -> None:
        pass

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        self.launched.append(spec)
        return SandboxHandle(self.name, spec.allocation_key, spec.sandbox_id, "ref")

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus(state="running", started_at_ms=1)


class FakeMps:
    def __init__(self, root: Path, fail: bool = False) -> None:
        self.root, self.fail = root, fail
        self.started: list[str] = []
        self.limits: dict[str, tuple[int, int]] = {}

    def set_server_limits(self, device: str, thread_pct: int, memory_mib: int) -> None:
        self.limits[device] = (thread_pct, memory_mib)

    def pipe_dir(self, device: str) -> Path:
        return self.root / device / "pipe"

    def running(self, device: str) -> bool:
        return device in self.started

    def start(self, device: str) -> bool:
        if self.fail:
            raise MpsError("nvidia-cuda-mps-control not found")
        self.started.append(device)
        return True

    def stop(self, device: str) -> bool:
        return False


def spec(device: str) -> SandboxSpec:
    return SandboxSpec(
        allocation_key="a1", sandbox_id=7, host="h", project="p", owner="o", image="", command=("sleep",),
        device_uuids=(device,), real_gpu=False, mps=MpsShare(pipe_dir="", thread_pct=30, memory_mib=4096),
    )  # fmt: skip


def agent(tmp_path: Path) -> tuple[Agent, RecordingDriver, str]:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    driver = RecordingDriver()
    a = Agent("h", backend, driver, tmp_path, AgentSettings(host="h", mps_dir=str(tmp_path / "mps")))  # type: ignore[arg-type]
    a.context.inventory.refresh()
    return a, driver, backend.list_gpus()[0].uuid


def test_simulated_gpu_gets_a_pipe_dir_without_a_daemon(
    tmp_path: Path, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, driver, device = agent(tmp_path)
    a.launch(spec(device))
    [launched] = driver.launched
    assert launched.mps is not None
    assert Path(launched.mps.pipe_dir) == tmp_path / "mps" / device_key(device) / "pipe"
    assert Path(launched.mps.pipe_dir).is_dir() and launched.mps.thread_pct == 30
    # Every directory down to the pipe is traversable by the sandbox's unprivileged uid.
    for directory in (Path(launched.mps.pipe_dir), *Path(launched.mps.pipe_dir).parents):
        if directory == tmp_path:
            break
        assert directory.stat().st_mode & 0o005 == 0o005, directory


def test_a_root_agent_keeps_mps_pipes_under_run_whatever_its_var_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout under /root (0700) hid the pipe directory from the sandbox's uid: bwrap
    failed with 'Can't find source path …/pipe: Permission denied' and MPS never ran."""
    root = mps_root(tmp_path)
    if os.geteuid() == 0:
        assert root == Path("/run/gpushare/mps")
    else:
        assert root == tmp_path / "mps"
    assert mps_root(tmp_path, "/srv/mps") == Path("/srv/mps")  # MPS_DIR


def test_real_gpu_starts_the_daemon_or_fails_the_launch(
    tmp_path: Path, sent_tasks: Any, monkeypatch: Any
) -> None:
    a, driver, device = agent(tmp_path)
    monkeypatch.setattr(a.context.backend, "simulated", False)
    fake = FakeMps(tmp_path / "mps")
    a.context.mps_daemons = MpsDaemons(fake)  # type: ignore[arg-type]
    a.launch(spec(device))
    assert fake.started == [device] and len(driver.launched) == 1
    assert fake.limits == {device: (30, 4096)}  # the server's, before the sandbox starts
    a.context.mps_daemons = MpsDaemons(FakeMps(tmp_path / "mps", fail=True))  # type: ignore[arg-type]
    a.launch(replace(spec(device), allocation_key="a2"))
    assert len(driver.launched) == 1
    [(_, _task, (sandbox_id, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert (sandbox_id, key) == (7, "a2") and "nvidia-cuda-mps-control not found" in message


def test_memory_reported_by_pid_is_summed_per_sandbox(tmp_path: Path) -> None:
    a, _, device = agent(tmp_path)
    sample = a.context.backend.sample(device)
    sample = replace(sample, mem_by_owner={"pid:10": 100, "pid:11": 50, "pid:12": 7, "pid:99": 1})
    a.reports._pid_owner = {"pid:10": "a1", "pid:11": "a1", "pid:12": "a2"}
    assert (
        a.reports.memory_of(sample, "a1"),
        a.reports.memory_of(sample, "a2"),
        a.reports.memory_of(sample, "a3"),
    ) == (150, 7, 0)
    keyed = replace(sample, mem_by_owner={"a1": 4096})  # the simulated backend knows its owners
    assert a.reports.memory_of(keyed, "a1") == 4096


def test_a_preemption_warning_runs_the_hook_then_signals_and_reports(tmp_path: Path, sent_tasks: Any) -> None:
    a, driver, _ = agent(tmp_path)
    said = tmp_path / "hook.out"
    hook = tmp_path / "hook"
    hook.write_text(
        "#!/bin/sh\n"
        f'echo "$1 $GPUSHARE_CHECKPOINT_REASON $GPUSHARE_STOP_IN_S $GPUSHARE_SANDBOX_ID" > {said}\n'
        "echo saved to /ckpt\n"
    )
    hook.chmod(0o755)
    a.context.settings = replace(a.context.settings, checkpoint_hook=str(hook))
    warned: list[str] = []

    def warn(handle: SandboxHandle) -> str:
        warned.append(said.read_text())
        return "SIGTERM sent"

    driver.warn = warn  # type: ignore[attr-defined]
    handle = SandboxHandle("recording", "a1", 7, "ref")
    a.warn("a1", handle.to_json(), time.time() + 90.5)
    assert warned == ["checkpoint preemption 90 7\n"]  # the hook ran first, the job still whole
    [(queue, _, args)] = [s for s in sent_tasks if s[1] == "sandbox_warned"]
    assert queue == "control" and args[0] == "a1"
    assert args[1].startswith("checkpoint done in") and args[1].endswith(": saved to /ckpt; SIGTERM sent")


def test_a_launch_for_another_isolation_level_is_refused(tmp_path: Path, sent_tasks: Any) -> None:
    a, driver, device = agent(tmp_path)
    driver.name = "process"  # this host gives process isolation; a VM request must not run here
    a.launch(replace(spec(device), mps=None, isolation="vm"))
    assert driver.launched == []
    [(_, _task, (sandbox_id, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert (sandbox_id, key) == (7, "a1") and message == "host h runs process sandboxes, not vm"


class SlowListingDriver(RecordingDriver):
    """Lists a sandbox only once its launch returns, as the process driver does (its state
    file is written after the sandbox is set up); the report is taken mid-launch."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: list[SandboxHandle] = []
        self.report_mid_launch: list[OwnedSandbox] = []
        self.agent: Agent | None = None

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        assert self.agent is not None
        self.agent.reports.build()  # a heartbeat's report, taken while this sandbox is set up
        self.report_mid_launch = self.agent.reports.ready[0] if self.agent.reports.ready else []
        handle = super().launch(spec)
        self.listed.append(handle)
        return handle

    def list_owned(self) -> list[SandboxHandle]:
        return list(self.listed)


def test_a_report_taken_during_a_launch_says_the_sandbox_is_coming(tmp_path: Path) -> None:
    """Without it, a report taken while bwrap set the sandbox up, and read by control once the
    sandbox ran, called it vanished: failed after two seconds (seen under load in CI)."""
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    driver = SlowListingDriver()
    a = Agent("h", backend, driver, tmp_path, AgentSettings(host="h", mps_dir=str(tmp_path / "mps")))  # type: ignore[arg-type]
    driver.agent = a
    a.context.inventory.refresh()
    a.launch(replace(spec(backend.list_gpus()[0].uuid), mps=None))
    assert driver.report_mid_launch == [
        {"allocation_key": "a1", "sandbox_id": 7, "state": "created", "tracked": True}
    ]
    a.reports.build()
    assert a.reports.ready is not None
    assert [(e["allocation_key"], e["state"]) for e in a.reports.ready[0]] == [("a1", "running")]


def test_a_launch_that_crashes_is_no_longer_reported_as_coming(tmp_path: Path) -> None:
    class CrashingDriver(RecordingDriver):
        def launch(self, spec: SandboxSpec) -> SandboxHandle:
            raise OSError("a bug in the driver")

        def list_owned(self) -> list[SandboxHandle]:
            return []

    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    settings = AgentSettings(host="h", mps_dir=str(tmp_path / "mps"))
    a = Agent("h", backend, CrashingDriver(), tmp_path, settings)  # type: ignore[arg-type]
    a.context.inventory.refresh()
    with pytest.raises(OSError):
        a.launch(replace(spec(backend.list_gpus()[0].uuid), mps=None))
    a.reports.build()
    assert a.context.sandboxes.launching == {} and a.reports.ready is not None and a.reports.ready[0] == []


def test_a_launch_reports_what_its_driver_prepares_then_launches(tmp_path: Path, sent_tasks: Any) -> None:
    class PullingDriver(RecordingDriver):
        def prepare(self, spec: SandboxSpec, report: Any) -> None:
            report("pulling r.example/a:1: 1 of 2 layers")

    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    settings = AgentSettings(host="h", mps_dir=str(tmp_path / "mps"))
    driver = PullingDriver()
    a = Agent("h", backend, driver, tmp_path, settings)  # type: ignore[arg-type]
    a.context.inventory.refresh()
    launched = replace(spec(backend.list_gpus()[0].uuid), mps=None)
    a.launch(launched)
    tasks = [(task, args) for _, task, args in sent_tasks if task in ("launch_progress", "sandbox_launched")]
    assert tasks[0] == ("launch_progress", (launched.allocation_key, "pulling r.example/a:1: 1 of 2 layers"))
    assert tasks[1][0] == "sandbox_launched" and driver.launched == [launched]


def test_a_spec_with_the_retired_metering_facts_still_reads() -> None:
    """An older portal's launch message, or a spec a process driver saved before the upgrade,
    carries the price and share the agent once costed samples with: read, and dropped."""
    old = {**spec("GPU-1").to_json(), "milli_gpu": 1000, "price_per_gpu_hour_micros": 2_500_000}
    assert SandboxSpec.from_json(old) == spec("GPU-1")
    with pytest.raises(TypeError):
        SandboxSpec.from_json({**old, "not_a_field": 1})  # anything else is still refused


def test_storage_is_measured_while_sandboxes_run_and_after_each_stops(
    tmp_path: Path, sent_tasks: Any
) -> None:
    a, driver, device = agent(tmp_path)
    root = tmp_path / "storage"
    driver.storage_dir = root  # type: ignore[assignment]
    driver.stop = lambda handle, grace_s=0: None  # type: ignore[attr-defined]
    home = root / "homes" / "3"
    home.mkdir(parents=True)
    (home / "weights.bin").write_bytes(b"x" * 200_000)
    (home / "same-weights.bin").hardlink_to(home / "weights.bin")  # counted once
    mounts = (
        StorageMount("home", "homes/3", "/home/sandbox", False, 1, volume=3),
        StorageMount("mnist", "datasets/mnist", "/data", True, 0),  # read-only: not measured
        StorageMount("shared", "projects/9", "/project", False, 2, volume=9),  # not on this host
    )
    a.launch(replace(spec(device), mps=None, mounts=mounts))
    a.launch(replace(spec(device), allocation_key="a2", sandbox_id=8, mps=None, mounts=mounts[:1]))
    # While they run, a round: each sandbox told what its volumes hold, a shared one walked once.
    a.meter.round()
    during = {args[0]: args[1] for _, task, args in sent_tasks if task == "storage_usage"}
    assert set(during) == {7, 8} and during[7] == during[8] and list(during[7]) == ["3"]
    sent_tasks.clear()
    a.stop("a1", SandboxHandle("recording", "a1", 7, "ref").to_json())
    told = [(task, args) for _, task, args in sent_tasks if task in ("sandbox_stopped", "storage_usage")]
    assert [task for task, _ in told] == ["sandbox_stopped", "storage_usage"]  # the stop first
    sandbox_id, usage = told[1][1]
    assert sandbox_id == 7 and list(usage) == ["3"]
    used, whole = usage["3"]
    assert whole and 200_000 <= used < 2 * 200_000
