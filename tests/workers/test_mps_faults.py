"""The MPS fault domain (issue 36 item 5, review 3 new failure #6): after an application XID
on a device MPS shares run on, every share's owner hears that a program on the GPU ended its
CUDA processes, the device's MPS server is recovered within a bound, and new shares wait for
it instead of starting into CUDA error 807.

The GPU is the fake NVML (nvml_fake.py: ``app_xid``) or the simulated backend; the MPS
control daemon is the stand-in of mps_control_fake.py, whose server refuses new clients
after a fault until its clients are gone. Bounds are shortened so each test takes seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.mps_control_fake import REFUSED, install
from tests.workers.nvml_fake import FakeNvml, app_xid
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from workers.drivers.base import SandboxStatus
from workers.drivers.output import OutputChunk
from workers.drivers.process import ProcessDriver
from workers.gpu import mps
from workers.gpu.mps import MpsManager
from workers.gpu.mps_daemons import MpsDaemons
from workers.gpu.mps_recovery import WAITING, MpsRecovery
from workers.gpu.nvml import NvmlBackend
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings
from workers.host.faults import MPS_FAULT_TEXT

GRACE_S, TERMINATE_S, BOUND_S = 0.2, 0.4, 8.0


def quick(daemons: MpsDaemons) -> MpsRecovery:
    """A recovery with bounds of a test's length."""
    return MpsRecovery(daemons, grace_s=GRACE_S, terminate_s=TERMINATE_S, bound_s=BOUND_S, poll_s=0.05)


class Began:
    """Stands in for ``MpsRecovery.begin``: what the faults asked to recover."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, device: str, why: str) -> bool:
        self.calls.append((device, why))
        return True


def share(key: str, sandbox_id: int, device: str) -> SandboxSpec:
    return SandboxSpec(
        key, sandbox_id, "h", "vision", "olivia", "img", ("sleep",), (device,), False, tier="t",
        mps=MpsShare("", 25, 1024),
    )  # fmt: skip


def plain(key: str, sandbox_id: int, device: str) -> SandboxSpec:
    return SandboxSpec(key, sandbox_id, "h", "vision", "olivia", "img", (), (device,), False, tier="t")


def xid_alerts(changes: list[Any]) -> dict[int, str]:
    return {c["sandbox"]: c["message"] for c in changes if c["kind"] == "xid" and c["state"] == "raised"}


# --- who is told what -------------------------------------------------------------------------


def test_an_application_xid_on_an_mps_gpu_tells_every_share_that_a_program_on_the_gpu_ended_its_processes(
    fake: FakeNvml, tmp_path: Path, sent_tasks: Any
) -> None:
    """Before: "…, from a program in the sandbox; the GPU is fine" to every sandbox on the GPU,
    and nothing done about the MPS server."""
    agent = Agent("h", NvmlBackend(), ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.inventory.refresh()
    gpu = fake.h100.uuid
    for key, sandbox_id in (("a1", 7), ("a2", 8), ("a3", 9)):
        agent.context.sandboxes.running[key] = share(key, sandbox_id, gpu)
    began = Began()
    agent.context.mps_recovery.begin = began  # type: ignore[method-assign]
    app_xid(fake, fake.h100, 31)  # one tenant's kernel touched memory it does not own
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    told = xid_alerts(changes)
    assert sorted(told) == [7, 8, 9]  # every share on the GPU, not only the one that faulted
    for message in told.values():
        assert MPS_FAULT_TEXT in message and message.startswith(
            f"sandbox {message.split()[1]} on h: XID 31: "
        )
        assert "not necessarily its own" in message and "the GPU itself is fine" in message
        assert "the GPU is fine" not in message and "from a program in the sandbox" not in message
        assert len(message) < 300  # whole, not cut by the alert's limit
    assert began.calls == [(gpu, "XID 31: GPU memory page fault (a kernel touched memory it does not own)")]
    assert [t for t in sent_tasks if t[1] == "gpu_faults"] == []  # and the GPU is not drained


def test_an_application_xid_on_a_device_without_mps_keeps_the_sandboxs_own_fault_text(
    fake: FakeNvml, tmp_path: Path, sent_tasks: Any
) -> None:
    agent = Agent("h", NvmlBackend(), ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.inventory.refresh()
    mine, neighbour = fake.mig(3).uuid, fake.mig(2).uuid
    agent.context.sandboxes.running["a1"] = plain("a1", 7, mine)
    agent.context.sandboxes.running["a2"] = share("a2", 8, neighbour)  # MPS on the other instance
    app_xid(fake, fake.mig(3), 13)
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    assert xid_alerts(changes) == {
        7: "sandbox 7 on h: XID 13: graphics engine exception (e.g. an illegal instruction or address "
        "in a kernel), from a program in the sandbox; the GPU is fine"
    }
    assert not agent.context.mps_recovery.holds(mine) and not agent.context.mps_recovery.holds(neighbour)


def test_an_application_xid_on_an_mps_mig_instance_tells_its_shares_and_recovers_its_daemon_only(
    fake: FakeNvml, tmp_path: Path, sent_tasks: Any
) -> None:
    agent = Agent("h", NvmlBackend(), ProcessDriver(tmp_path / "sandboxes", host="h"), tmp_path)
    agent.context.inventory.refresh()
    faulted, other = fake.mig(2).uuid, fake.mig(3).uuid
    agent.context.sandboxes.running["a1"] = share("a1", 7, faulted)
    agent.context.sandboxes.running["a2"] = share("a2", 8, faulted)
    agent.context.sandboxes.running["a3"] = share("a3", 9, other)
    began = Began()
    agent.context.mps_recovery.begin = began  # type: ignore[method-assign]
    app_xid(fake, fake.mig(2), 43)
    changes = agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())
    told = xid_alerts(changes)
    assert sorted(told) == [7, 8] and all(MPS_FAULT_TEXT in m for m in told.values())
    assert [device for device, _ in began.calls] == [faulted]


# --- the stand-in daemon, its clients, and a driver whose sandboxes are MPS clients ----------------


@pytest.fixture
def var_dir() -> Iterator[Path]:
    # Short on purpose: the daemon's socket path must fit in a sockaddr_un (108 bytes).
    path = Path(tempfile.mkdtemp(prefix="mpsf-", dir="/tmp"))
    yield path
    for proc in Path("/proc").iterdir():  # daemons and servers a failed test left
        with contextlib.suppress(OSError, ValueError):
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


class Programs:
    """Stand-ins for the sandboxes' CUDA programs: real processes, MPS clients once connected."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> int:
        process = subprocess.Popen(["sleep", "60"])
        self.processes.append(process)
        return process.pid

    def stop_all(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def programs() -> Iterator[Programs]:
    made = Programs()
    yield made
    made.stop_all()


@pytest.fixture
def control(var_dir: Path) -> MpsManager:
    # The recovery alone: compute modes (EXCLUSIVE_PROCESS) are test_mps_enforced.py's.
    return MpsManager(var_dir / "mps", control_binary=str(install(var_dir)), systemd=False, enforce=False)


def connect(control: MpsManager, device: str, pid: int) -> str:
    """A CUDA program's first call on the device: the server's answer."""
    return control.command(device, f"fake_client_connect {pid}")


def control_log(control: MpsManager, device: str) -> list[str]:
    return (control.log_dir(device) / "control.log").read_text().splitlines()


GPU = "GPU-0d6bde6e-8b1e-4a4a-9a64-6a3c2c2f5a10"


def faulted_server(control: MpsManager, programs: Programs, clients: int = 2) -> MpsDaemons:
    """Two shares on GPU whose programs are clients of its server, which then faults."""
    daemons = MpsDaemons(control)
    for n in range(1, clients + 1):
        assert daemons.claim(share(f"a{n}", n, GPU)).refusal == ""
        assert connect(control, GPU, programs.start()).startswith("connected ")
    assert control.command(GPU, "fake_fault").startswith("faulted ")
    assert connect(control, GPU, programs.start()) == REFUSED  # as NVIDIA documents: 807 until they exit
    return daemons


# --- recovery -----------------------------------------------------------------------------------


def test_recovery_terminates_the_faulted_clients_within_the_bound(
    control: MpsManager, programs: Programs
) -> None:
    daemons = faulted_server(control, programs)
    recovery = quick(daemons)
    started = time.monotonic()
    assert recovery.begin(GPU, "XID 31") and not recovery.begin(GPU, "XID 31 again")
    assert recovery.join(GPU, BOUND_S)
    took = time.monotonic() - started
    assert took < GRACE_S + TERMINATE_S + 2.0, took  # no restart was needed
    assert recovery.failure(GPU) == ""
    [server] = control.server_pids(GPU)
    faulted = programs.processes[:2]
    assert [f"Cmd:terminate_client {server} {p.pid}" in control_log(control, GPU) for p in faulted] == [
        True,
        True,
    ]
    assert connect(control, GPU, programs.start()) == f"connected {server}"  # accepting again
    assert [line for line in control_log(control, GPU) if line.startswith("START")] == ["START"]
    programs.stop_all()  # quit waits for clients
    control.stop(GPU)


def test_clients_that_exit_with_the_fault_are_not_terminated(control: MpsManager, programs: Programs) -> None:
    """The common case: the faulted programs died of the error; the server serves again once
    they are gone, and no command is needed."""
    daemons = faulted_server(control, programs)
    recovery = quick(daemons)
    recovery.grace_s = 5.0
    recovery.begin(GPU, "XID 31")
    programs.stop_all()
    assert recovery.join(GPU, BOUND_S) and recovery.failure(GPU) == ""
    log = control_log(control, GPU)
    assert not [line for line in log if "terminate_client" in line] and log.count("START") == 1
    assert connect(control, GPU, programs.start()).startswith("connected ")
    programs.stop_all()
    control.stop(GPU)


def test_a_server_whose_clients_do_not_let_go_is_restarted_with_its_limits(
    control: MpsManager, programs: Programs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """terminate_client detaches no one, and quit waits for clients: the daemon is killed with
    its server and started again, the shares' server limits given again."""
    monkeypatch.setenv("FAKE_MPS_STUBBORN", "1")
    monkeypatch.setattr(mps, "STOP_TIMEOUT_S", 0.5)
    daemons = faulted_server(control, programs)
    [old_server] = control.server_pids(GPU)
    recovery = quick(daemons)
    recovery.begin(GPU, "XID 13")
    assert recovery.join(GPU, BOUND_S) and recovery.failure(GPU) == ""
    log = control_log(control, GPU)
    assert log.count("START") == 2 and "Cmd:quit" in log
    assert log.index("Cmd:set_default_active_thread_percentage 25", log.index("START", 1)) > 0
    assert not mps._alive(old_server)
    assert connect(control, GPU, programs.start()).startswith("connected ")  # a new server
    assert control.server_pids(GPU) != [old_server]
    programs.stop_all()
    control.stop(GPU)


def test_a_recovery_with_no_share_left_stops_the_daemon_rather_than_restarts_it(
    control: MpsManager, programs: Programs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_STUBBORN", "1")
    monkeypatch.setattr(mps, "STOP_TIMEOUT_S", 0.5)
    daemons = faulted_server(control, programs, clients=1)
    programs.stop_all()  # its program ended, and so does the share: release quits the daemon
    daemons.release("a1")
    recovery = quick(daemons)
    recovery.begin(GPU, "XID 31")
    assert recovery.join(GPU, BOUND_S) and recovery.failure(GPU) == ""
    assert not control.running(GPU)


# --- launches while the server recovers -------------------------------------------------------------


class ClientDriver:
    """Runs sandboxes in memory; each MPS share's program becomes a client of its device's
    server as it starts, and what the server answered is kept."""

    name = "process"
    storage_dir = None

    def __init__(self, control: MpsManager, programs: Programs) -> None:
        self.control = control
        self.programs = programs
        self.live: dict[str, SandboxSpec] = {}
        self.answers: dict[str, str] = {}

    def prepare(self, spec: SandboxSpec, report: Any) -> None:
        pass

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        self.answers[spec.allocation_key] = connect(self.control, spec.device_uuids[0], self.programs.start())
        self.live[spec.allocation_key] = spec
        return SandboxHandle(self.name, spec.allocation_key, spec.sandbox_id, spec.allocation_key)

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        self.live.pop(handle.allocation_key, None)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        running = handle.allocation_key in self.live
        return SandboxStatus(state="running" if running else "missing", started_at_ms=1)

    def list_owned(self) -> list[SandboxHandle]:
        return []

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        return OutputChunk(offset, b"", offset)


def mps_agent(tmp_path: Path, control: MpsManager, programs: Programs) -> tuple[Agent, ClientDriver, str]:
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    driver = ClientDriver(control, programs)
    agent = Agent("h", backend, driver, tmp_path, AgentSettings(host="h"))  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    agent.context.mps_daemons = MpsDaemons(control)
    agent.context.mps_recovery = quick(agent.context.mps_daemons)
    gpu = backend.list_gpus()[0].uuid
    for n in (1, 2):
        agent.launch(share(f"a{n}", n, gpu))
    assert all(a.startswith("connected ") for a in driver.answers.values())
    return agent, driver, gpu


def fault(agent: Agent, gpu: str, control: MpsManager) -> None:
    assert control.command(gpu, "fake_fault").startswith("faulted ")
    agent.context.backend.inject_xid(gpu, 31)  # type: ignore[attr-defined]
    agent.faults.report(agent.context.sandboxes.specs(), [], agent.context.inventory.parent_of())


def test_a_share_launched_while_the_server_recovers_waits_and_starts_once_it_accepts(
    tmp_path: Path, control: MpsManager, programs: Programs, sent_tasks: Any
) -> None:
    """Before: the share started at once, and its first CUDA call failed with 807."""
    agent, driver, gpu = mps_agent(tmp_path, control, programs)
    fault(agent, gpu, control)
    assert agent.context.mps_recovery.recovering(gpu)
    seen_launching: list[bool] = []
    launched = driver.launch

    def launch(spec: SandboxSpec) -> SandboxHandle:
        seen_launching.append(agent.context.mps_recovery.recovering(gpu))
        return launched(spec)

    driver.launch = launch  # type: ignore[method-assign]
    late = threading.Thread(target=agent.launch, args=(share("a3", 3, gpu),))
    late.start()
    time.sleep(0.1)
    assert "a3" in agent.context.sandboxes.launching  # the heartbeat says it is coming
    late.join(BOUND_S)
    assert not late.is_alive()
    assert seen_launching == [False]  # the driver ran only once the server had recovered
    assert driver.answers["a3"].startswith("connected ")  # no 807
    progress = [t[2] for t in sent_tasks if t[1] == "launch_progress"]
    assert ("a3", WAITING) in progress
    assert not [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]


def test_a_share_fails_with_the_reason_when_the_server_does_not_recover_and_the_next_one_recovers_it(
    tmp_path: Path, control: MpsManager, programs: Programs, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_STUBBORN", "1")
    monkeypatch.setattr(mps, "STOP_TIMEOUT_S", 0.5)
    agent, driver, gpu = mps_agent(tmp_path, control, programs)
    monkeypatch.setenv("FAKE_MPS_FAIL", "no CUDA-capable device is detected")  # the restart's start fails
    fault(agent, gpu, control)
    agent.launch(share("a3", 3, gpu))
    [(_, _, (_, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert key == "a3" and "a3" not in driver.live
    assert message.startswith(
        f"the MPS server of {gpu} did not recover from a fault of a program on the GPU: "
    )
    assert "no CUDA-capable device is detected" in message
    monkeypatch.delenv("FAKE_MPS_FAIL")  # whatever held it is gone: the next share recovers the server
    agent.launch(share("a4", 4, gpu))
    assert driver.answers["a4"].startswith("connected ")
    assert agent.context.mps_recovery.failure(gpu) == ""


def test_a_share_on_a_server_still_recovering_after_the_bound_is_refused_with_the_reason(
    tmp_path: Path, control: MpsManager, programs: Programs, sent_tasks: Any
) -> None:
    agent, driver, gpu = mps_agent(tmp_path, control, programs)
    recovery = agent.context.mps_recovery
    recovery.bound_s = 0.3
    recovery.grace_s = 5.0  # the faulted clients get longer than a launch waits
    fault(agent, gpu, control)
    agent.launch(share("a3", 3, gpu))
    [(_, _, (_, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert key == "a3" and "a3" not in driver.live
    assert message == (
        f"the MPS server of {gpu} is still recovering from a fault of a program on the GPU after 0.3 s: "
        "launch again shortly"
    )
    programs.stop_all()  # the faulted programs exit: the server recovers by itself
    assert recovery.join(gpu, 5.0) and recovery.failure(gpu) == ""
