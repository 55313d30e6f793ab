"""The agent keeps each GPU's MPS daemon up exactly while MPS shares hold the GPU (or it is
pinned to MPS), on the simulated backend (``SimulatedMps``: the daemon's stand-in).

A hypothesis state machine plays the control plane against a real ``Agent``: it launches
dedicated sandboxes (one or two GPUs), MPS shares and time-slice replicas wherever the
scheduler could place them (GPUs following demand, or pinned), stops them, pins and unpins
GPUs as the fleet page allows, sends launches the scheduler never would (a share beside a
whole GPU), and restarts the agent (the driver keeps what runs; the control plane has it
adopted, maybe after stopping some first). The driver checks, as each sandbox starts, that
a share finds its daemon up and nothing else finds one; after every step the daemons must
be up exactly where shares are (a GPU pinned to MPS may keep its daemon between shares).
Then a few threads race a share's launch against the last share's stop.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from scheduler.defrag import DESTROY, MigMove, MigPlan
from wire import dispatch
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError, SandboxStatus
from workers.drivers.output import OutputChunk
from workers.gpu.mps import MpsError
from workers.gpu.mps_daemons import MpsDaemons
from workers.gpu.mps_simulated import SimulatedMps
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings

GPUS = 4
REPLICAS = 4
MODES = ("auto", "dedicated", "mps", "timeslice")


class CheckingDriver:
    """Runs sandboxes in memory and checks each start against the GPU's daemon."""

    name = "process"
    storage_dir = None  # mounts no storage

    def __init__(self) -> None:
        self.live: dict[str, SandboxSpec] = {}
        self.violations: list[str] = []
        self.daemons: MpsDaemons | None = None  # the current agent's (it changes on a restart)
        self.slow_stop_s = 0.0

    def prepare(self, spec: SandboxSpec, report: Any) -> None:
        pass

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        assert self.daemons is not None
        if spec.allocation_key not in self.live:
            for device in spec.device_uuids:
                up = self.daemons.control.running(device)
                if spec.mps is not None and not up:
                    self.violations.append(
                        f"share {spec.allocation_key} started on {device} without a daemon"
                    )
                if spec.mps is None and up:
                    self.violations.append(f"{spec.allocation_key} started on {device} under an MPS daemon")
            if spec.mps is not None and not spec.mps.pipe_dir:
                self.violations.append(f"share {spec.allocation_key} got no pipe directory")
            if spec.mps is not None and spec.device_uuids:
                # The server's limits, in place before the share's first CUDA call, reach its grant.
                control = self.daemons.control
                assert isinstance(control, SimulatedMps)
                limits = control.limits(spec.device_uuids[0])
                if limits is None or limits[0] < spec.mps.thread_pct or limits[1] < spec.mps.memory_mib:
                    self.violations.append(
                        f"share {spec.allocation_key} started under server limits {limits}"
                    )
        self.live[spec.allocation_key] = spec
        return self.handle(spec.allocation_key)

    def handle(self, key: str) -> SandboxHandle:
        return SandboxHandle(self.name, key, self.live[key].sandbox_id, key)

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        time.sleep(self.slow_stop_s)
        self.live.pop(handle.allocation_key, None)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        running = handle.allocation_key in self.live
        return SandboxStatus(state="running" if running else "missing", started_at_ms=1)

    def list_owned(self) -> list[SandboxHandle]:
        return [self.handle(key) for key in list(self.live)]

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        return OutputChunk(offset, b"", offset)


@dataclass
class Sent:
    """What the agent told the control plane."""

    failed: list[tuple[str, str]] = field(default_factory=list)  # (allocation id, message)

    def to_control(self, task: str, *args: Any) -> None:
        if task == "sandbox_launch_failed":
            self.failed.append((args[1], args[2]))


def grant(key: str) -> tuple[int, int]:
    """A share's (thread %, pinned MiB): shares of several sizes meet on one GPU."""
    n = int(key[1:])
    return 10 * (1 + n % 3), 1024 * (1 + n % 4)


def _spec(key: str, devices: tuple[str, ...], kind: str, pinned: bool = False) -> SandboxSpec:
    share = MpsShare("", *grant(key)) if kind == "mps" else None
    return SandboxSpec(
        allocation_key=key, sandbox_id=int(key[1:]), host="h", project="p", owner="o", image="",
        command=("sleep",), device_uuids=devices, real_gpu=False, mps=share, mps_pinned=pinned,
    )  # fmt: skip


class AgentAgainstTheControlPlane(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="mps-daemons-"))
        self.sent = Sent()
        self.patches: list[Any] = [
            mock.patch.multiple(dispatch, to_control=self.sent.to_control, to_host=lambda *a: None),
        ]
        for patch in self.patches:
            patch.start()
        self.backend = SimulatedBackend("h", parse_sim_spec(f"H100-80GB:{GPUS}"))
        self.gpus = [g.uuid for g in self.backend.list_gpus()]
        self.driver = CheckingDriver()
        self.agent = self._start_agent()
        self.mode = dict.fromkeys(self.gpus, "auto")  # what the admin set (the portal's Gpu mode)
        self.kind: dict[str, str] = {}  # allocation id -> dedicated | mps | timeslice
        self.keys = (f"a{n}" for n in itertools.count(1))
        self.told = dict.fromkeys(self.gpus, "auto")  # each GPU's mode as its agent last heard it
        self.late: list[tuple[str, str]] = []  # mode messages not delivered yet
        self.launched = 0

    def _start_agent(self) -> Agent:
        settings = AgentSettings(host="h", mps_dir=str(self.tmp / "mps"))
        agent = Agent("h", self.backend, self.driver, self.tmp, settings)  # type: ignore[arg-type]
        agent.context.mps_daemons.handover_s = 0  # a conflicting launch is refused at once, not waited for
        agent.context.inventory.refresh()
        self.driver.daemons = agent.context.mps_daemons
        return agent

    # --- the fleet as the control plane sees it --------------------------------------------

    def on(self, gpu: str) -> list[str]:
        return [k for k, spec in self.driver.live.items() if gpu in spec.device_uuids]

    def serving(self, gpu: str) -> str:
        """What the GPU serves now: its pin, else what holds it ("idle" when nothing)."""
        if self.mode[gpu] != "auto":
            return self.mode[gpu]
        held = {self.kind[k] for k in self.on(gpu)}
        return held.pop() if held else "idle"

    def takes(self, gpu: str, kind: str) -> bool:
        """Whether the scheduler could place ``kind`` on ``gpu`` now."""
        if self.serving(gpu) not in (kind, "idle"):
            return False
        held = len(self.on(gpu))
        return {"dedicated": held == 0, "mps": held < 10, "timeslice": held < REPLICAS}[kind]

    def _send(self, spec: SandboxSpec) -> None:
        """A launch message; a share's spec tells the agent whether its GPU is pinned to MPS."""
        if spec.mps is not None:
            self.told[spec.device_uuids[0]] = "mps" if spec.mps_pinned else "auto"
        self.agent.launch(spec)

    def _launch(self, kind: str, devices: tuple[str, ...]) -> str:
        key = next(self.keys)
        self.kind[key] = kind
        self._send(_spec(key, devices, kind, pinned=kind == "mps" and self.mode[devices[0]] == "mps"))
        return key

    # --- rules ---------------------------------------------------------------------------

    @initialize(modes=st.lists(st.sampled_from(MODES), min_size=GPUS, max_size=GPUS))
    def pin_some(self, modes: list[str]) -> None:
        for index, mode in enumerate(modes):
            self.set_mode(index, mode, late=False)

    @rule(
        kind=st.sampled_from(("dedicated", "mps", "timeslice")),
        index=st.integers(0, GPUS - 1),
        two=st.booleans(),
    )
    def launch(self, kind: str, index: int, two: bool) -> None:
        gpus = self.gpus[index:] + self.gpus[:index]
        free = [g for g in gpus if self.takes(g, kind)]
        if not free:
            return
        devices = tuple(free[:2]) if kind == "dedicated" and two and len(free) > 1 else (free[0],)
        key = self._launch(kind, devices)
        assert key in self.driver.live, self.sent.failed  # a placement the scheduler makes runs
        self.launched += 1

    @rule(index=st.integers(0, GPUS - 1))
    def launch_share(self, index: int) -> None:
        """MPS shares are what the daemons are about: drawn more often than the rest."""
        self.launch("mps", index, two=False)

    @rule(index=st.integers(0, GPUS - 1), late=st.booleans())
    def pin_to_mps_or_back(self, index: int, late: bool) -> None:
        gpu = self.gpus[index]
        self.set_mode(index, "auto" if self.mode[gpu] == "mps" else "mps", late)

    @rule(kind=st.sampled_from(("dedicated", "mps", "timeslice")), index=st.integers(0, GPUS - 1))
    def launch_beside_another_mode(self, kind: str, index: int) -> None:
        """A launch the scheduler would not send (a stale message): refused, nothing runs."""
        gpu = self.gpus[index]
        others = {self.kind[k] for k in self.on(gpu)} - {kind}
        if (
            not others
            or (kind == "timeslice" and others == {"dedicated"})
            or (kind == "dedicated" and others == {"timeslice"})
        ):
            return  # only a share against a non-share (or the reverse) is the daemon's to refuse
        key = self._launch(kind, (gpu,))
        assert key not in self.driver.live and self.sent.failed[-1][0] == key

    @precondition(lambda self: bool(self.driver.live))
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.driver.live)))
        self.agent.stop(key, self.driver.handle(key).to_json())

    @rule(index=st.integers(0, GPUS - 1), mode=st.sampled_from(MODES), late=st.booleans())
    def set_mode(self, index: int, mode: str, late: bool) -> None:
        """An admin's pin or unpin; its message to the agent may come late, after launches
        the scheduler made with the new mode."""
        gpu = self.gpus[index]
        if mode != "auto" and {self.kind[k] for k in self.on(gpu)} - {mode}:
            return  # the fleet page refuses a pin the GPU's sandboxes contradict
        self.mode[gpu] = mode
        self.late.append((gpu, mode))
        if not late:
            self.deliver_late_messages()

    @rule()
    def deliver_late_messages(self) -> None:
        for gpu, mode in self.late:
            self.told[gpu] = mode
            self.agent.gpu_mode(gpu, mode)  # the portal's message after commit
        self.late.clear()

    @rule(stop_first=st.lists(st.booleans(), max_size=6))
    def restart_the_agent(self, stop_first: list[bool]) -> None:
        """A new agent on the same host: the driver (and the daemons) kept running. The
        control plane has it adopt what runs, maybe after stopping some first (orphans)."""
        self.agent = self._start_agent()
        self.told = dict.fromkeys(self.gpus, "auto")  # a new agent knows no pin
        self.agent.reports.build()  # untracked sandboxes: nothing may be swept yet
        for gpu in self.gpus:
            if any(self.kind[k] == "mps" for k in self.on(gpu)):
                assert self.agent.context.mps_daemons.control.running(gpu), (
                    f"{gpu}: unadopted shares lost their daemon"
                )
        for key, stop in zip(sorted(self.driver.live), stop_first, strict=False):
            if stop:  # stopped before it was adopted
                self.agent.stop(key, self.driver.handle(key).to_json())
        for key in sorted(self.driver.live):
            self._send(self.driver.live[key])
        self.agent.reports.build()  # everything tracked: what no share holds is swept

    @rule()
    def heartbeat(self) -> None:
        self.agent.reports.build()

    # --- what must hold --------------------------------------------------------------------

    @invariant()
    def daemons_run_exactly_where_shares_are(self) -> None:
        """Right after each step, not only after a heartbeat's sweep."""
        assert not self.driver.violations, self.driver.violations
        control = self.agent.context.mps_daemons.control
        for gpu in self.gpus:
            kinds = {self.kind[k] for k in self.on(gpu)}
            up = control.running(gpu)
            assert len(kinds) <= 1, (gpu, kinds)
            if "mps" in kinds:
                assert up, f"{gpu} holds shares without a daemon"
            elif kinds:
                assert not up, f"{gpu} runs {kinds} under an MPS daemon"
            elif self.told[gpu] != "mps":
                assert not up, f"{gpu} is idle and its agent knows no MPS pin, yet its daemon runs"
            shares = [grant(k) for k in self.on(gpu) if self.kind[k] == "mps"]
            if shares:  # the server holds every client to the largest share, no further
                assert isinstance(control, SimulatedMps)
                largest = (max(p for p, _ in shares), max(m for _, m in shares))
                assert control.limits(gpu) == largest, (gpu, control.limits(gpu), shares)

    def teardown(self) -> None:
        event("launches that ran", self.launched)
        for patch in reversed(self.patches):
            patch.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.mark.slow  # ~20 s on 2 cores: make test runs it, make test-fast leaves it out
@pytest.mark.timeout(600)
def test_the_mps_daemon_follows_the_gpus_mode() -> None:
    run_state_machine_as_test(
        AgentAgainstTheControlPlane,
        settings=settings(
            max_examples=300,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,  # the same runs in CI every time
            suppress_health_check=list(HealthCheck),
        ),
    )


# --- races ---------------------------------------------------------------------------------


def _agent(tmp_path: Path, driver: CheckingDriver) -> tuple[Agent, str]:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, driver, tmp_path, AgentSettings(host="h", mps_dir=str(tmp_path / "mps")))  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    driver.daemons = agent.context.mps_daemons
    return agent, backend.list_gpus()[0].uuid


def test_a_share_launched_while_the_last_one_stops_never_runs_without_its_daemon(
    tmp_path: Path, sent_tasks: Any
) -> None:
    driver = CheckingDriver()
    driver.slow_stop_s = 0.05  # the stop's window, for the launch to land in
    agent, gpu = _agent(tmp_path, driver)
    for round_ in range(20):
        first, second = f"a{2 * round_ + 1}", f"a{2 * round_ + 2}"
        agent.launch(_spec(first, (gpu,), "mps"))
        go = threading.Barrier(2)

        def stop_first(key: str = first, go: threading.Barrier = go) -> None:
            go.wait()
            agent.stop(key, driver.handle(key).to_json())

        def launch_second(
            key: str = second, go: threading.Barrier = go, delay: float = 0.003 * round_
        ) -> None:
            go.wait()
            time.sleep(delay)  # now before the stop's release, now after it
            agent.launch(_spec(key, (gpu,), "mps"))

        threads = [threading.Thread(target=stop_first), threading.Thread(target=launch_second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not driver.violations, driver.violations
        assert set(driver.live) == {second} and agent.context.mps_daemons.control.running(gpu)
        agent.stop(second, driver.handle(second).to_json())
        assert not agent.context.mps_daemons.control.running(gpu)  # following demand: idle, no daemon


def test_a_whole_gpu_waits_for_the_last_share_to_stop_then_runs_without_the_daemon(
    tmp_path: Path, sent_tasks: Any
) -> None:
    """The share's stop and the dedicated launch that follows it on the control plane may run
    on two task threads in either order: the launch waits for the stop, within a bound."""
    driver = CheckingDriver()
    driver.slow_stop_s = 0.3
    agent, gpu = _agent(tmp_path, driver)
    agent.launch(_spec("a1", (gpu,), "mps"))
    stopping = threading.Thread(target=agent.stop, args=("a1", driver.handle("a1").to_json()))
    stopping.start()
    time.sleep(0.05)  # the stop is under way, its share still registered
    agent.launch(_spec("a2", (gpu,), "dedicated"))
    stopping.join()
    assert set(driver.live) == {"a2"} and not driver.violations
    assert not agent.context.mps_daemons.control.running(gpu)
    history = agent.context.mps_daemons.control.history  # type: ignore[attr-defined]
    assert history == [("start", gpu), ("stop", gpu)]

    agent.context.mps_daemons.handover_s = 0.1  # a share whose stop never comes: refused, and said why
    agent.launch(_spec("a3", (gpu,), "mps"))
    [(_, _task, (_, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert key == "a3" and "still runs a dedicated or time-slice sandbox" in message
    assert "a3" not in driver.live and not agent.context.mps_daemons.control.running(gpu)


def test_a_resent_launch_that_fails_leaves_the_first_copys_claim(tmp_path: Path, sent_tasks: Any) -> None:
    """The control plane resends a launch it has not heard back about; the resend may arrive
    while the first copy still waits for its GPU. Both then pass the wait, one registers the
    share, and a failing launch of the other must not release it: the daemon would stop under
    the running share."""
    driver = CheckingDriver()
    driver.slow_stop_s = 0.3
    agent, gpu = _agent(tmp_path, driver)
    agent.launch(_spec("d1", (gpu,), "dedicated"))
    stopping = threading.Thread(target=agent.stop, args=("d1", driver.handle("d1").to_json()))
    stopping.start()
    time.sleep(0.05)  # the whole GPU's stop under way: both copies of the share wait for it
    launched = driver.launch
    calls: list[str] = []

    def second_copy_fails(spec: SandboxSpec) -> SandboxHandle:
        calls.append(spec.allocation_key)
        if len(calls) == 2:
            raise DriverError("a container of that name is being created")
        return launched(spec)

    driver.launch = second_copy_fails  # type: ignore[method-assign]
    copies = [threading.Thread(target=agent.launch, args=(_spec("s2", (gpu,), "mps"),)) for _ in range(2)]
    for copy in copies:
        copy.start()
    for copy in [stopping, *copies]:
        copy.join()
    assert calls == ["s2", "s2"] and set(driver.live) == {"s2"}
    assert agent.context.mps_daemons.control.running(gpu), (
        "the failed copy released the running share's daemon"
    )
    agent.stop("s2", driver.handle("s2").to_json())
    assert not agent.context.mps_daemons.control.running(gpu) and not driver.violations


def test_a_gpu_pinned_to_mps_keeps_its_daemon_until_it_is_unpinned(tmp_path: Path, sent_tasks: Any) -> None:
    driver = CheckingDriver()
    agent, gpu = _agent(tmp_path, driver)
    agent.launch(_spec("a1", (gpu,), "mps", pinned=True))
    agent.stop("a1", driver.handle("a1").to_json())
    assert agent.context.mps_daemons.control.running(gpu)  # pinned: it stays up between shares
    agent.reports.build()  # and the heartbeat's sweep leaves it
    assert agent.context.mps_daemons.control.running(gpu)
    agent.gpu_mode(gpu, "auto")  # the admin lets it follow demand
    assert not agent.context.mps_daemons.control.running(gpu)


def test_a_daemon_left_up_by_an_agent_that_died_is_stopped_once_nothing_is_left_to_adopt(
    tmp_path: Path, sent_tasks: Any
) -> None:
    driver = CheckingDriver()
    agent, gpu = _agent(tmp_path, driver)
    agent.launch(_spec("a1", (gpu,), "mps"))
    restarted, _ = _agent(tmp_path, driver)  # the daemon's marker survives, like its pid file
    restarted.reports.build()  # a1 runs, untracked: its daemon must stay
    assert restarted.context.mps_daemons.control.running(gpu)
    restarted.stop("a1", driver.handle("a1").to_json())  # an orphan's stop: it was never adopted
    restarted.reports.build()  # nothing runs and nothing is left to adopt: the daemon goes
    assert not restarted.context.mps_daemons.control.running(gpu)
    assert isinstance(restarted.context.mps_daemons.control, SimulatedMps)
    assert restarted.context.mps_daemons.control.history == [("stop", gpu)]


def test_a_cpu_only_sandbox_claims_no_gpu(tmp_path: Path, sent_tasks: Any) -> None:
    driver = CheckingDriver()
    agent, gpu = _agent(tmp_path, driver)
    agent.launch(replace(_spec("a1", (), "dedicated"), cpu_limit=2.0))
    agent.launch(_spec("a2", (gpu,), "mps"))
    assert set(driver.live) == {"a1", "a2"} and not driver.violations
    agent.stop("a1", driver.handle("a1").to_json())
    assert agent.context.mps_daemons.control.running(gpu)  # the share still holds it


def test_the_server_holds_every_share_to_the_largest_one_on_its_gpu(tmp_path: Path, sent_tasks: Any) -> None:
    """One MPS uid per GPU, so one server, whose limits cannot differ between clients: they
    are the largest share's, set before a share's sandbox starts, so a tenant who unsets its
    environment gets no more than the largest grant on the GPU."""
    driver = CheckingDriver()
    agent, gpu = _agent(tmp_path, driver)
    control = agent.context.mps_daemons.control
    assert isinstance(control, SimulatedMps)
    agent.launch(_spec("a1", (gpu,), "mps"))  # 20 %, 2 GiB
    assert control.limits(gpu) == (20, 2048)
    agent.launch(_spec("a5", (gpu,), "mps"))  # 30 %, 2 GiB
    agent.launch(_spec("a7", (gpu,), "mps"))  # 20 %, 4 GiB
    assert control.limits(gpu) == (30, 4096) and not driver.violations
    agent.stop("a7", driver.handle("a7").to_json())
    assert control.limits(gpu) == (30, 2048)  # lowered for the clients that come next
    agent.stop("a5", driver.handle("a5").to_json())
    assert control.limits(gpu) == (20, 2048)
    agent.stop("a1", driver.handle("a1").to_json())
    assert not control.running(gpu) and control.limits(gpu) is None


def test_a_share_whose_limits_the_daemon_refuses_does_not_run(
    tmp_path: Path, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = CheckingDriver()
    agent, gpu = _agent(tmp_path, driver)

    def refuse(device: str, thread_pct: int, memory_mib: int) -> None:
        raise MpsError("Unrecognized command")

    monkeypatch.setattr(agent.context.mps_daemons.control, "set_server_limits", refuse)
    agent.launch(_spec("a1", (gpu,), "mps"))
    [(_, _task, (_, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert key == "a1" and "Unrecognized command" in message
    assert not driver.live and not agent.context.mps_daemons.control.running(gpu)  # not left up idle


def test_a_mig_re_layout_quits_the_instances_mps_daemon_before_destroying_it(
    tmp_path: Path, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review §2.2: an MPS server outlives its last client, and NVML refuses to destroy an
    instance a process (the server) still holds. A share on a MIG instance pinned to MPS
    leaves its daemon up; the plan that destroys the instance must quit it first."""
    driver = CheckingDriver()
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1:mig=0"))
    agent = Agent("h", backend, driver, tmp_path, AgentSettings(host="h", mps_dir=str(tmp_path / "mps")))  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    driver.daemons = agent.context.mps_daemons
    gpu = backend.list_gpus()[0].uuid
    doomed, *_ = backend.mig_layout(gpu)
    agent.launch(_spec("a1", (doomed.uuid,), "mps", pinned=True))
    agent.stop("a1", driver.handle("a1").to_json())
    control = agent.context.mps_daemons.control
    assert control.running(doomed.uuid)  # pinned: up between shares, as its server would be
    destroy = backend.destroy_mig
    held: list[bool] = []

    def destroy_unless_held(parent: str, mig: str) -> None:
        held.append(control.running(mig))
        destroy(parent, mig)

    monkeypatch.setattr(backend, "destroy_mig", destroy_unless_held)
    move = MigMove(DESTROY, gpu, doomed.profile, doomed.start, instance=doomed.uuid)
    plan = MigPlan(doomed.profile, gpu, doomed.start, (move,), ())
    outcome = agent.plans.execute(9, [], plan.to_json(), {})
    assert outcome.error == "" and held == [False]
    assert doomed.uuid not in {m.uuid for m in backend.mig_layout(gpu)}

    # A share still on an instance the plan destroys: nothing is stopped, the plan is refused.
    survivor, *_ = backend.mig_layout(gpu)
    agent.launch(_spec("a2", (survivor.uuid,), "mps"))
    move = MigMove(DESTROY, gpu, survivor.profile, survivor.start, instance=survivor.uuid)
    outcome = agent.plans.execute(10, [], MigPlan(survivor.profile, gpu, 0, (move,), ()).to_json(), {})
    assert "it holds sandbox 2; stop the sandbox first" in outcome.error
    assert control.running(survivor.uuid) and held == [False]
    with pytest.raises(MpsError, match="MPS shares still run on"):  # asked directly, it says so too
        agent.context.mps_daemons.retire(survivor.uuid)
    assert control.running(survivor.uuid)
