"""MPS enforced (issue 36 item 1; review 3, §1.1 items 1-2, §1.4, new failure #2).

A tenant who unsets or changes ``CUDA_MPS_PIPE_DIRECTORY`` runs without MPS, with the whole
device and no limit, unless the device is in EXCLUSIVE_PROCESS; a tenant who can write the
pipe directory can remove the daemon's ``control`` socket, or forge the pid file the agent
took for the daemon. Here, on the stand-in control binary (test_mps_manager.py) and the fake
NVML (nvml_fake.py) through ``NvmlBackend``:

- every device that serves MPS is set to EXCLUSIVE_PROCESS (a MIG device on its own handle),
  read back after every start, set back to DEFAULT when it leaves MPS; a share whose device
  cannot be set, does not keep it, or does not answer is refused, with the reason, and the
  launch fails with it;
- the pipe directory is root:<mps gid> 1770: a tenant's process cannot remove ``control``;
- the daemon is its systemd unit's main pid, or the pid the agent recorded in a root-only
  place: a forged or removed pid file in the pipe directory changes nothing.
"""

# The fixtures imported from test_mps_manager are parameters here by name.
# ruff: noqa: F811

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tests.workers.nvml_fake import Dev, FakeNvml
from tests.workers.test_mps_daemons import CheckingDriver, _spec
from tests.workers.test_mps_manager import (  # noqa: F401 - fixtures
    GPU_A,
    FakeSystemd,
    _no_systemd,
    control_binary,
    control_log,
    manager,
    modes,
    var_dir,
)
from wire import uids
from workers.gpu import mps, posix_acl
from workers.gpu.base import COMPUTE_DEFAULT, COMPUTE_EXCLUSIVE_PROCESS, GpuBackendError
from workers.gpu.mps import PID_FILE, MpsError, MpsManager, MpsNotEnforced, _alive
from workers.gpu.mps_daemons import MpsDaemons
from workers.gpu.mps_simulated import SimulatedMps
from workers.gpu.nvml import NvmlBackend
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent
from workers.host.agent_settings import AgentSettings

EXCLUSIVE = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT


def device(fake: FakeNvml, uuid: str) -> Dev:
    return next(dev for dev in fake.gpus if dev.uuid == uuid)


def starts(manager: MpsManager, uuid: str) -> int:
    return len([line for line in control_log(manager, uuid) if line.startswith("START")])


def set_calls(fake: FakeNvml) -> list[tuple[str, int]]:
    return [(dev.uuid, mode) for dev, mode in fake.called("nvmlDeviceSetComputeMode")]


# --- compute mode ------------------------------------------------------------------------------


def test_the_backends_set_a_mig_devices_own_mode_and_refuse_its_parents(
    modes: NvmlBackend, fake: FakeNvml
) -> None:
    """nvml.h: "If MIG is enabled on a GPU, device must be MIG device handle"."""
    mig = fake.mig(3)
    modes.set_compute_mode(mig.uuid, COMPUTE_EXCLUSIVE_PROCESS)
    assert fake.called("nvmlDeviceSetComputeMode") == [(mig, EXCLUSIVE)]
    assert modes.compute_mode(mig.uuid) == COMPUTE_EXCLUSIVE_PROCESS
    assert (modes.compute_mode(fake.mig(2).uuid), modes.compute_mode(fake.a100.uuid)) == (
        "default",
        "default",
    )
    with pytest.raises(GpuBackendError, match=f"set compute mode exclusive_process on {fake.a100.uuid}"):
        modes.set_compute_mode(fake.a100.uuid, COMPUTE_EXCLUSIVE_PROCESS)
    with pytest.raises(GpuBackendError, match="no compute mode 'exclusive_thread'"):
        modes.set_compute_mode(mig.uuid, "exclusive_thread")

    simulated = SimulatedBackend("h", parse_sim_spec("H100-80GB:1:mig=0"))
    gpu = simulated.list_gpus()[0]
    first, second = gpu.mig_devices[:2]
    simulated.set_compute_mode(first.uuid, COMPUTE_EXCLUSIVE_PROCESS)
    assert (simulated.compute_mode(first.uuid), simulated.compute_mode(second.uuid)) == (
        COMPUTE_EXCLUSIVE_PROCESS,
        COMPUTE_DEFAULT,
    )
    with pytest.raises(GpuBackendError, match="in MIG mode"):
        simulated.set_compute_mode(gpu.uuid, COMPUTE_EXCLUSIVE_PROCESS)


def test_a_whole_gpu_is_exclusive_process_while_its_daemon_runs_and_default_after(
    manager: MpsManager, fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = device(fake, GPU_A)
    seen: list[tuple[int, bool]] = []  # (mode set, daemon up then)
    setter = pynvml.nvmlDeviceSetComputeMode  # the fake's

    def set_and_note(dev: Dev, mode: int) -> None:
        seen.append((mode, manager.running(GPU_A)))
        setter(dev, mode)

    monkeypatch.setattr(pynvml, "nvmlDeviceSetComputeMode", set_and_note)
    assert manager.start(GPU_A) is True
    assert gpu.compute_mode == EXCLUSIVE
    assert seen == [(EXCLUSIVE, False)]  # before the daemon, as NVIDIA's recipe has it
    reads = len(fake.called("nvmlDeviceGetComputeMode"))
    assert manager.start(GPU_A) is False  # the next share's start reads it back again
    assert len(fake.called("nvmlDeviceGetComputeMode")) > reads
    assert manager.stop(GPU_A) is True
    assert gpu.compute_mode == DEFAULT and seen[1:] == [(DEFAULT, False)]  # once the daemon is gone


def test_a_mig_share_sets_its_own_mig_device_never_its_parent_or_siblings(
    manager: MpsManager, fake: FakeNvml
) -> None:
    """nvml.h: "If MIG is enabled on a GPU, device must be MIG device handle". The earlier
    code left MIG devices alone ("the mode is the whole GPU's"): a MIG tenant could leave MPS."""
    mig, sibling = fake.mig(3), fake.mig(2)
    manager.start(mig.uuid)
    assert (mig.compute_mode, sibling.compute_mode, fake.a100.compute_mode) == (EXCLUSIVE, DEFAULT, DEFAULT)
    assert set_calls(fake) == [(mig.uuid, EXCLUSIVE)]
    manager.start(sibling.uuid)  # each instance its own mode, its own daemon
    manager.stop(mig.uuid)
    assert (mig.compute_mode, sibling.compute_mode) == (DEFAULT, EXCLUSIVE)
    manager.stop(sibling.uuid)
    assert sibling.compute_mode == DEFAULT and fake.a100.compute_mode == DEFAULT


def test_a_share_is_refused_when_the_compute_mode_cannot_be_set(manager: MpsManager, fake: FakeNvml) -> None:
    device(fake, GPU_A).compute_mode_refused = pynvml.NVML_ERROR_NO_PERMISSION  # a non-root agent
    with pytest.raises(
        MpsNotEnforced,
        match=f"this MPS share cannot be enforced on {GPU_A}: compute mode not set to EXCLUSIVE_PROCESS "
        r"\(.*Insufficient Permissions\)",
    ):
        manager.start(GPU_A)
    assert starts(manager, GPU_A) == 0 and not manager.running(GPU_A)


def test_a_share_is_refused_when_the_compute_mode_does_not_stick(manager: MpsManager, fake: FakeNvml) -> None:
    device(fake, GPU_A).compute_mode_sticks = False
    with pytest.raises(
        MpsNotEnforced,
        match=f"this MPS share cannot be enforced on {GPU_A}: compute mode is DEFAULT after setting "
        r"EXCLUSIVE_PROCESS \(a tenant could run its CUDA past the MPS daemon",
    ):
        manager.start(GPU_A)
    assert starts(manager, GPU_A) == 0 and not manager.running(GPU_A)


def test_a_share_is_refused_when_nvml_cannot_read_the_mode(manager: MpsManager, fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceGetComputeMode"] = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(
        MpsNotEnforced, match=f"cannot be enforced on {GPU_A}: compute mode not set .*Unknown"
    ):
        manager.start(GPU_A)
    assert starts(manager, GPU_A) == 0


def test_a_mode_lost_under_a_running_daemon_is_set_again_or_the_next_share_refused(
    manager: MpsManager, fake: FakeNvml
) -> None:
    gpu = device(fake, GPU_A)
    manager.start(GPU_A)
    gpu.compute_mode = DEFAULT  # an operator's `nvidia-smi -c 0`
    assert manager.start(GPU_A) is False and gpu.compute_mode == EXCLUSIVE
    gpu.compute_mode, gpu.compute_mode_sticks = DEFAULT, False
    with pytest.raises(MpsNotEnforced, match="compute mode is DEFAULT after setting EXCLUSIVE_PROCESS"):
        manager.start(GPU_A)
    gpu.compute_mode_sticks = True
    manager.stop(GPU_A)
    assert gpu.compute_mode == DEFAULT


def test_a_mode_that_reads_back_wrong_once_the_daemon_is_up_quits_the_daemon(
    manager: MpsManager, fake: FakeNvml, modes: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = modes.compute_mode

    def changed_once_the_daemon_runs(uuid: str) -> str:
        return COMPUTE_DEFAULT if starts(manager, uuid) else read(uuid)

    monkeypatch.setattr(modes, "compute_mode", changed_once_the_daemon_runs)
    with pytest.raises(MpsNotEnforced, match="compute mode is DEFAULT after setting EXCLUSIVE_PROCESS"):
        manager.start(GPU_A)
    assert control_log(manager, GPU_A)[-2:] == ["Cmd:quit", "EXIT"]  # not left up
    assert not manager.running(GPU_A) and device(fake, GPU_A).compute_mode == DEFAULT


def test_a_failed_start_and_a_killed_daemon_leave_no_exclusive_mode_behind(
    manager: MpsManager,
    fake: FakeNvml,
    modes: NvmlBackend,
    control_binary: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = device(fake, GPU_A)
    monkeypatch.setenv("FAKE_MPS_FAIL", "no CUDA-capable device is detected")
    with pytest.raises(MpsError, match="no CUDA-capable"):
        manager.start(GPU_A)
    assert gpu.compute_mode == DEFAULT
    monkeypatch.delenv("FAKE_MPS_FAIL")
    manager.start(GPU_A)
    os.kill(int((manager.pipe_dir(GPU_A) / PID_FILE).read_text()), signal.SIGKILL)
    later = MpsManager(manager.root, control_binary=str(control_binary), compute_modes=modes)  # a restart
    deadline = time.monotonic() + 5
    while later.running(GPU_A) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert later.stop(GPU_A) is False  # as before a dedicated sandbox: no daemon, yet
    assert gpu.compute_mode == DEFAULT  # the mode it left is put back


def test_a_manager_told_not_to_enforce_never_touches_compute_modes(
    var_dir: Path, control_binary: Path, modes: NvmlBackend, fake: FakeNvml
) -> None:
    """What the gpu-marked tests on a lent GPU use (test_mps_real.py): its compute mode must
    never change there. The agent never builds one (HostContext.assemble)."""
    manager = MpsManager(
        var_dir / "mps", control_binary=str(control_binary), compute_modes=modes, enforce=False
    )
    manager.start(GPU_A)
    manager.stop(GPU_A)
    assert not fake.called("nvmlDeviceSetComputeMode") and not fake.called("nvmlDeviceGetComputeMode")
    with pytest.raises(MpsNotEnforced, match="no GPU backend"):  # enforcing, with nothing to enforce by
        MpsManager(var_dir / "other", control_binary=str(control_binary)).start(GPU_A)


def test_the_retired_setting_is_named_at_start(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("GPUSHARE_HOST", "h")
    monkeypatch.setenv("MPS_EXCLUSIVE_PROCESS", "false")
    settings = AgentSettings.from_env()
    assert not hasattr(settings, "mps_exclusive_process")
    assert (
        "MPS_EXCLUSIVE_PROCESS=false is no longer read: every GPU or MIG device that serves MPS"
        in caplog.text
    )


# --- the launch that cannot be enforced fails, and says why ------------------------------------


def test_a_sandbox_whose_share_cannot_be_enforced_is_not_started_and_its_launch_fails_with_why(
    tmp_path: Path, sent_tasks: Any
) -> None:
    driver = CheckingDriver()
    backend = SimulatedBackend("h", parse_sim_spec("H100-80GB:1"))
    agent = Agent("h", backend, driver, tmp_path, AgentSettings(host="h", mps_dir=str(tmp_path / "mps")))  # type: ignore[arg-type]
    agent.context.inventory.refresh()
    driver.daemons = agent.context.mps_daemons
    gpu = backend.list_gpus()[0].uuid
    agent.launch(_spec("a1", (gpu,), "mps"))  # the simulated backend models the mode too
    assert backend.compute_mode(gpu) == COMPUTE_EXCLUSIVE_PROCESS
    agent.stop("a1", driver.handle("a1").to_json())
    assert backend.compute_mode(gpu) == COMPUTE_DEFAULT

    backend.refuse_compute_mode.add(gpu)
    agent.launch(_spec("a2", (gpu,), "mps"))
    [(_, _task, (_, key, message))] = [t for t in sent_tasks if t[1] == "sandbox_launch_failed"]
    assert key == "a2" and message.startswith(
        f"this MPS share cannot be enforced on {gpu}: compute mode not set"
    )
    control = agent.context.mps_daemons.control
    assert isinstance(control, SimulatedMps)
    assert "a2" not in driver.live and not control.running(gpu)


# --- the pipe directory ------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root agent's sandboxes run as its own uid")
def test_a_tenant_cannot_remove_the_control_socket_or_the_pid_file(
    manager: MpsManager, var_dir: Path
) -> None:
    """Review 3 §1.1 item 2: the pipe directory was the MPS uid's 0700, so any tenant of the
    GPU could unlink ``control``, and every later CUDA process of every tenant ran without MPS.
    Root's now, group the MPS gid, sticky: the tenant (a real process of the GPU's MPS uid and
    gid, as its sandboxes run) can still make its own files there, and so can its MPS server,
    which NVIDIA's control daemon runs as that uid with gid 0 and no other group (seen on an
    H200: with the group's permission alone the server exited at once, every client 805)."""
    var_dir.chmod(0o711)
    manager.start(GPU_A)
    pipe = manager.pipe_dir(GPU_A)
    uid = uids.mps_uid(GPU_A)

    def as_tenant(*argv: str, user: int = uid, group: int = uid) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), user=user, group=group, extra_groups=[], capture_output=True, text=True, check=False
        )

    for name in ("control", PID_FILE):
        removed = as_tenant("rm", "-f", str(pipe / name))
        assert removed.returncode != 0 and "Operation not permitted" in removed.stderr, removed
        moved = as_tenant("mv", str(pipe / name), str(pipe / "mine"))
        assert moved.returncode != 0, moved
    assert as_tenant("sh", "-c", f": > {pipe}/tenant-file").returncode == 0
    server = as_tenant("sh", "-c", f": > {pipe}/server-socket", group=0)  # how its MPS server runs
    assert server.returncode == 0, server
    stranger = as_tenant("sh", "-c", f": > {pipe}/planted", user=uid + 1, group=0)
    assert stranger.returncode != 0 and "Permission denied" in stranger.stderr, stranger
    assert posix_acl.named_users(pipe) == {uid: 0o7}
    assert (pipe / "control").is_socket() and (pipe / "control").stat().st_uid == os.geteuid()
    info = pipe.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, uid, 0o1770)
    assert manager.stop(GPU_A) is True


# --- which process is the daemon -----------------------------------------------------------------


def test_a_forged_or_removed_pid_file_changes_nothing(
    manager: MpsManager, control_binary: Path, modes: NvmlBackend
) -> None:
    """The pid file lives where tenants write (before this change they could replace it): a
    decoy's pid in it made ``stop`` wait on the decoy and raise; no pid file made ``start``
    start a second daemon."""
    manager.start(GPU_A)
    pid_file = manager.pipe_dir(GPU_A) / PID_FILE
    daemon = int(pid_file.read_text())
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        pid_file.write_text(f"{decoy.pid}\n")
        restarted = MpsManager(manager.root, control_binary=str(control_binary), compute_modes=modes)
        for agent in (manager, restarted):
            assert agent.running(GPU_A) and agent.start(GPU_A) is False
        assert starts(manager, GPU_A) == 1
        assert restarted.stop(GPU_A) is True  # quits the daemon, does not wait on the decoy
        assert not _alive(daemon) and decoy.poll() is None
        assert not manager.running(GPU_A)

        manager.start(GPU_A)
        (manager.pipe_dir(GPU_A) / PID_FILE).unlink()
        assert manager.running(GPU_A) and manager.start(GPU_A) is False
        assert starts(manager, GPU_A) == 2  # the second start of the test, no third
        assert manager.stop(GPU_A) is True
    finally:
        decoy.kill()
        decoy.wait()


def test_under_systemd_the_daemon_is_its_units_main_pid(
    var_dir: Path, control_binary: Path, modes: NvmlBackend
) -> None:
    systemd = FakeSystemd()

    def agent() -> MpsManager:
        return MpsManager(
            var_dir / "mps",
            control_binary=str(control_binary),
            runner=systemd,
            systemd=True,
            compute_modes=modes,
        )

    first = agent()
    first.start(GPU_A)
    unit = first.unit(GPU_A)
    daemon = systemd.main_pids[unit]
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        (first.pipe_dir(GPU_A) / PID_FILE).write_text(f"{decoy.pid}\n")
        restarted = agent()  # adopts by MainPID
        assert restarted.start(GPU_A) is False and starts(first, GPU_A) == 1
        assert ["systemctl", "show", "-p", "MainPID", "--value", unit] in systemd.calls
        assert restarted.stop(GPU_A) is True and not _alive(daemon) and decoy.poll() is None

        # No unit (MainPID 0), while the pid file names a live process: no daemon runs.
        systemd.main_pids[unit] = 0
        assert not agent().running(GPU_A)
    finally:
        decoy.kill()
        decoy.wait()


def test_the_recorded_daemon_lives_in_a_root_only_state_directory(manager: MpsManager) -> None:
    manager.start(GPU_A)
    state = manager.root / mps.device_key(GPU_A) / mps.STATE_DIR
    info = state.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o700)
    pid, _started = (state / mps.DAEMON_STATE).read_text().split()
    assert int(pid) == int((manager.pipe_dir(GPU_A) / PID_FILE).read_text())
    manager.stop(GPU_A)
    assert not (state / mps.DAEMON_STATE).exists()


def test_housekeeping_goes_on_when_systemd_does_not_answer(
    var_dir: Path, control_binary: Path, modes: NvmlBackend, caplog: Any
) -> None:
    """The daemon's identity is now asked of systemd: a systemd that does not answer must not
    stop the agent's reports (the sweep runs in every heartbeat's report)."""

    def no_systemd(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.CompletedProcess(argv, 1, "", "Failed to connect to bus: No such file or directory")

    manager = MpsManager(
        var_dir / "mps",
        control_binary=str(control_binary),
        runner=no_systemd,
        systemd=True,
        compute_modes=modes,
    )
    daemons = MpsDaemons(manager)
    daemons.sweep([GPU_A])
    daemons.set_pinned(GPU_A, False)
    assert (
        "cannot tell whether the MPS daemon of" in caplog.text and "Failed to connect to bus" in caplog.text
    )
    with pytest.raises(MpsError, match=r"systemctl show -p MainPID --value gpushare-mps-.* exited 1"):
        manager.start(GPU_A)  # a share is refused, saying why
