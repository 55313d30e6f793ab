"""MpsManager against a stand-in ``nvidia-cuda-mps-control``.

There is no GPU here, so the tests write an executable that behaves like NVIDIA's control
binary where MpsManager relies on it: ``-d`` forks a background daemon that writes
``nvidia-cuda-mps-control.pid`` and listens on the ``control`` socket in
``CUDA_MPS_PIPE_DIRECTORY``; without arguments the binary forwards its stdin to that daemon
and prints the answers; ``quit`` ends the daemon. The daemon writes every command it
received to ``control.log`` in ``CUDA_MPS_LOG_DIRECTORY`` (as the real one logs ``Cmd:``
lines there), which is what the tests read. tests/workers/test_mps_real.py runs the same
calls against the real binary on a GPU host.

Compute modes go through ``NvmlBackend`` over the fake NVML (tests/workers/nvml_fake.py),
which holds the devices these tests name (``modes``); tests/workers/test_mps_enforced.py
follows them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.nvml_fake import Dev, FakeNvml
from wire import uids
from wire.spec import MpsShare, SandboxSpec
from workers.gpu import mps
from workers.gpu.mps import PID_FILE, MpsError, MpsManager, _alive, _start_time, device_key, mps_root
from workers.gpu.nvml import NvmlBackend

GPU_A = "GPU-0d6bde6e-8b1e-4a4a-9a64-6a3c2c2f5a10"
GPU_B = "GPU-5b3f0b83-2f5e-4b63-a3a8-9a0b5f1c7e22"
MIG = "MIG-4f6b8a3e-1c2d-5e6f-8a9b-0c1d2e3f4a5b"

FAKE_CONTROL = r"""
import json, os, socket, subprocess, sys, time

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
logdir = os.environ["CUDA_MPS_LOG_DIRECTORY"]
sock_path = os.path.join(pipe, "control")
pid_path = os.path.join(pipe, "nvidia-cuda-mps-control.pid")


def record(line):
    with open(os.path.join(logdir, "control.log"), "a") as f:
        f.write(line + "\n")


def daemon():
    servers = json.loads(os.environ.get("FAKE_MPS_SERVERS", "{}"))
    defaults = {"thread": "100", "mem": {}}
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock_path)
    server.listen(4)
    record("START visible=%s pipe=%s log=%s" % (os.environ.get("CUDA_VISIBLE_DEVICES"), pipe, logdir))
    with open(pid_path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_path + ".tmp", pid_path)
    while True:
        conn, _ = server.accept()
        data = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        out, quit_ = [], False
        for line in data.decode().splitlines():
            line = line.strip()
            if not line:
                continue
            record("Cmd:" + line)
            words = line.split()
            if words == ["quit"]:
                quit_ = True
            elif words[0] == "set_default_active_thread_percentage" and len(words) == 2:
                defaults["thread"] = words[1]
            elif words == ["get_default_active_thread_percentage"]:
                out.append(defaults["thread"] + ".0")
            elif words[0] == "set_default_device_pinned_mem_limit" and len(words) == 3:
                defaults["mem"][words[1]] = words[2]
            elif words[0] == "get_default_device_pinned_mem_limit" and len(words) == 2:
                out.append(defaults["mem"].get(words[1], "0M"))
            elif words[0] in ("set_active_thread_percentage", "set_device_pinned_mem_limit"):
                if words[1] not in servers:
                    out.append("Server %s not found" % words[1])
            elif words == ["get_server_list"]:
                out.extend(servers)
            elif words[0] == "get_client_list" and len(words) == 2:
                if words[1] in servers:
                    out.extend(str(p) for p in servers[words[1]])
                else:
                    out.append("Server %s not found" % words[1])
            else:
                out.append("Unrecognized command: " + line)
        conn.sendall(("\n".join(out) + ("\n" if out else "")).encode())
        conn.close()
        if quit_:
            os.unlink(sock_path)
            os.unlink(pid_path)
            record("EXIT")
            return


if sys.argv[1:] == ["-d"]:
    if os.path.exists(pid_path):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    if os.environ.get("FAKE_MPS_FAIL"):
        print("Failed to start MPS control daemon: " + os.environ["FAKE_MPS_FAIL"], file=sys.stderr)
        sys.exit(1)
    subprocess.Popen([sys.executable, __file__, "--serve"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.exit(0)
elif sys.argv[1:] == ["--serve"]:
    daemon()
elif not sys.argv[1:]:
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(sock_path)
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    client.sendall(sys.stdin.read().encode())
    client.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        chunk = client.recv(4096)
        if not chunk:
            break
        reply += chunk
    sys.stdout.write(reply.decode())
else:
    print("usage: nvidia-cuda-mps-control [-d | -f]", file=sys.stderr)
    sys.exit(2)
"""


@pytest.fixture(autouse=True)
def _no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Daemons start directly unless a test hands the manager a systemd to run them."""
    monkeypatch.setattr(mps, "systemd_runs", lambda: False)


@pytest.fixture
def control_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(f"#!{sys.executable}\n{FAKE_CONTROL}")
    binary.chmod(0o755)
    return binary


@pytest.fixture
def var_dir() -> Iterator[Path]:
    # Short on purpose: the daemon's socket path must fit in a sockaddr_un (108 bytes).
    path = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    yield path
    for pid_file in path.glob(f"mps/*/pipe/{PID_FILE}"):  # a test that failed midway
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def modes(fake: FakeNvml) -> Iterator[NvmlBackend]:
    """The GPU backend that sets and reads compute modes: NVML, faked, with GPU_A and GPU_B
    beside the fake's own H100 and A100 (whose MIG devices the MIG tests use)."""
    fake.gpus += [Dev(GPU_A, "NVIDIA H100 80GB HBM3", 81559), Dev(GPU_B, "NVIDIA H100 80GB HBM3", 81559)]
    backend = NvmlBackend()
    yield backend
    backend.close()


@pytest.fixture
def manager(var_dir: Path, control_binary: Path, modes: NvmlBackend) -> MpsManager:
    return MpsManager(var_dir / "mps", control_binary=str(control_binary), compute_modes=modes)


def control_log(manager: MpsManager, uuid: str) -> list[str]:
    path = manager.log_dir(uuid) / "control.log"
    return path.read_text().splitlines() if path.exists() else []


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_start_gives_the_pipe_dir_to_the_devices_clients_alone_and_binds_the_daemon_to_its_device(
    manager: MpsManager, var_dir: Path
) -> None:
    assert not manager.running(GPU_A)
    assert manager.start(GPU_A) is True
    assert manager.running(GPU_A)
    key = device_key(GPU_A)
    pipe, logs = var_dir / "mps" / key / "pipe", var_dir / "mps" / key / "log"
    assert (manager.pipe_dir(GPU_A), manager.log_dir(GPU_A)) == (pipe, logs)
    assert (var_dir / "mps" / key / "device").read_text() == GPU_A + "\n"
    # Traversable down to the pipe directory, listable by nobody else; only the device's MPS
    # group (every client of this daemon, and its MPS server, runs in it) may enter the pipe
    # directory and make its sockets there, and the sticky bit keeps root's from them.
    dirs = (var_dir / "mps", var_dir / "mps" / key, pipe, logs, var_dir / "mps" / key / "state")
    assert [mode(d) for d in dirs] == [0o711, 0o711, 0o1770, 0o700, 0o700]
    group = uids.mps_uid(GPU_A) if os.geteuid() == 0 else os.getegid()
    assert (pipe.stat().st_uid, pipe.stat().st_gid) == (os.geteuid(), group)
    assert logs.stat().st_uid == os.geteuid()
    assert control_log(manager, GPU_A) == [f"START visible={GPU_A} pipe={pipe} log={logs}"]
    assert (pipe / "control").is_socket()
    manager.stop(GPU_A)


def test_start_is_idempotent_also_for_a_new_manager(
    manager: MpsManager, control_binary: Path, modes: NvmlBackend
) -> None:
    manager.start(GPU_A)
    assert manager.start(GPU_A) is False
    # An agent restart: a fresh manager finds the daemon through the root-only state it recorded.
    again = MpsManager(manager.root, control_binary=str(control_binary), compute_modes=modes)
    assert again.running(GPU_A) and again.start(GPU_A) is False
    assert [line for line in control_log(manager, GPU_A) if line.startswith("START")] != []
    assert len([line for line in control_log(manager, GPU_A) if line.startswith("START")]) == 1
    again.stop(GPU_A)


def test_defaults_are_sent_as_nvidia_documents_them(manager: MpsManager) -> None:
    manager.start(GPU_A)
    manager.set_default_active_thread_percentage(GPU_A, 25)
    manager.set_default_pinned_mem_limit(GPU_A, 8192)
    assert manager.command(GPU_A, "get_default_active_thread_percentage") == "25.0"
    # The one visible device is device 0 to the daemon, whatever its index on the host.
    assert manager.command(GPU_A, "get_default_device_pinned_mem_limit 0") == "8192M"
    assert control_log(manager, GPU_A)[1:] == [
        "Cmd:set_default_active_thread_percentage 25",
        "Cmd:set_default_device_pinned_mem_limit 0 8192M",
        "Cmd:get_default_active_thread_percentage",
        "Cmd:get_default_device_pinned_mem_limit 0",
    ]
    with pytest.raises(MpsError, match=r"1\.\.100, not 0"):
        manager.set_default_active_thread_percentage(GPU_A, 0)
    with pytest.raises(MpsError, match="at least 1 MiB"):
        manager.set_default_pinned_mem_limit(GPU_A, 0)
    with pytest.raises(MpsError, match="one command per call"):
        manager.command(GPU_A, "get_server_list\nquit")
    assert manager.running(GPU_A)
    manager.stop(GPU_A)


def test_server_and_client_lists(
    manager: MpsManager, monkeypatch: pytest.MonkeyPatch, fake: FakeNvml
) -> None:
    monkeypatch.setenv("FAKE_MPS_SERVERS", json.dumps({"4100": [4242, 4243], "4200": []}))
    mig = fake.mig(3).uuid
    manager.start(mig)  # mig devices get their own daemon the same way
    assert manager.server_pids(mig) == [4100, 4200]
    assert manager.client_pids(mig, 4100) == [4242, 4243]
    assert manager.client_pids(mig, 999) == []  # "Server 999 not found" is no pid
    assert manager.clients(mig) == {4100: [4242, 4243], 4200: []}
    assert "Cmd:get_client_list 4100" in control_log(manager, mig)
    manager.stop(mig)


def test_stop_quits_through_stdin_and_leaves_other_devices_alone(manager: MpsManager) -> None:
    manager.start(GPU_A)
    manager.start(GPU_B)
    pid = int((manager.pipe_dir(GPU_A) / PID_FILE).read_text())
    assert manager.stop(GPU_A) is True
    assert control_log(manager, GPU_A)[-2:] == ["Cmd:quit", "EXIT"]
    assert not manager.running(GPU_A) and not (manager.pipe_dir(GPU_A) / PID_FILE).exists()
    assert not _alive(pid)  # gone, or a zombie its reaper has yet to collect
    assert manager.stop(GPU_A) is False
    assert manager.running(GPU_B) and manager.server_pids(GPU_B) == []
    manager.stop(GPU_B)


def test_a_stale_pid_file_does_not_count_as_a_daemon(manager: MpsManager) -> None:
    manager.start(GPU_A)
    manager.stop(GPU_A)
    pipe = manager.pipe_dir(GPU_A)
    (pipe / PID_FILE).write_text("999999999")  # a daemon killed -9 leaves this behind
    assert not manager.running(GPU_A)
    assert manager.start(GPU_A) is True
    manager.stop(GPU_A)


def test_errors_are_mps_errors(
    manager: MpsManager, var_dir: Path, monkeypatch: pytest.MonkeyPatch, modes: NvmlBackend
) -> None:
    with pytest.raises(MpsError, match=f"no MPS daemon runs for {GPU_A}"):
        manager.command(GPU_A, "get_server_list")
    with pytest.raises(MpsError, match="not a device UUID"):
        manager.start("../etc")
    monkeypatch.setenv("FAKE_MPS_FAIL", "no CUDA-capable device is detected")
    with pytest.raises(MpsError, match=r"-d for GPU-0d6b.* exited 1: Failed to start .* no CUDA-capable"):
        manager.start(GPU_A)
    missing = MpsManager(var_dir / "mps", control_binary=str(var_dir / "nope"), compute_modes=modes)
    with pytest.raises(MpsError, match="not found: is the NVIDIA driver installed"):
        missing.start(GPU_B)
    deep = MpsManager(var_dir / ("x" * 80) / "mps", control_binary=str(var_dir / "nope"))
    with pytest.raises(MpsError, match=r"too long for a UNIX socket .* set MPS_DIR to a shorter"):
        deep.start(GPU_A)


def test_share_feeds_the_sandbox_environment(manager: MpsManager) -> None:
    share = manager.share(GPU_A, thread_pct=30, memory_mib=20_000)
    assert share == MpsShare(str(manager.pipe_dir(GPU_A)), 30, 20_000)
    spec = SandboxSpec("alloc-1", 1, "host-a", "proj", "ann", "img", (), (GPU_A,), real_gpu=True, mps=share)
    env = spec.gpu_env()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(manager.pipe_dir(GPU_A))
    assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
        "30",
        "0=20000M",
    )
    with pytest.raises(MpsError, match=r"1\.\.100"):
        manager.share(GPU_A, 101, 1)


HOLDS_STDOUT = """#!/bin/sh
# Like the real binary's -d: the daemon it leaves behind inherits stdout and stderr.
if [ "$1" = "-d" ]; then
    echo "starting the daemon"
    sleep 60 &
    echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    exit 0
fi
exit 1
"""


def test_start_returns_while_the_daemon_holds_the_inherited_stdout(
    var_dir: Path, monkeypatch: pytest.MonkeyPatch, modes: NvmlBackend
) -> None:
    """Under capture_output the start read the daemon's stdout to its end, which comes only
    when the daemon exits: it timed out (15 s) with the daemon up."""
    binary = var_dir / "holds-stdout"
    binary.write_text(HOLDS_STDOUT)
    binary.chmod(0o755)
    monkeypatch.setattr(mps, "COMMAND_TIMEOUT_S", 3.0)  # the old code's wait, shortened
    manager = MpsManager(var_dir / "mps", control_binary=str(binary), compute_modes=modes)
    try:
        assert manager.start(GPU_A) is True
        assert (manager.log_dir(GPU_A) / mps.START_LOG).read_text() == "starting the daemon\n"
    finally:
        pid_file = manager.pipe_dir(GPU_A) / PID_FILE
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_failed_start_says_what_the_binary_printed(var_dir: Path, modes: NvmlBackend) -> None:
    binary = var_dir / "fails"
    binary.write_text('#!/bin/sh\necho "An instance of this daemon is already running" >&2\nexit 1\n')
    binary.chmod(0o755)
    manager = MpsManager(var_dir / "mps", control_binary=str(binary), compute_modes=modes)
    with pytest.raises(MpsError, match="exited 1: An instance of this daemon is already running"):
        manager.start(GPU_A)


def test_socket_paths_fit_whatever_the_hostname(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Finding 6: the root agent's path held the hostname and the full UUID, so a hostname of
    19 characters or more (an FQDN) put the control socket past 107 bytes."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    root = mps_root(tmp_path)  # on gpu-node-017.rack-12.datacenter-west.example.internal
    assert root == Path("/run/gpushare/mps")
    socket_path = MpsManager(root).pipe_dir(MIG) / "control"
    assert socket_path == Path("/run/gpushare/mps", device_key(MIG), "pipe", "control")
    assert len(os.fsencode(socket_path)) <= 40
    assert mps_root(tmp_path, "/srv/mps") == Path("/srv/mps")


def test_two_devices_on_one_key_are_refused_not_mixed_up(manager: MpsManager) -> None:
    directory = manager.pipe_dir(GPU_A).parent
    directory.mkdir(parents=True)
    (directory / "device").write_text(GPU_B + "\n")  # as if GPU_B's UUID hashed to GPU_A's key
    with pytest.raises(MpsError, match=f"belongs to {GPU_B}, not {GPU_A}: their keys collide"):
        manager.start(GPU_A)


def test_server_limits_are_the_defaults_and_each_running_servers_own(
    manager: MpsManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Limits the tenant cannot lift: a client's environment only narrows what the server
    holds it to. The defaults bind the next server; a running one needs its own, by pid."""
    monkeypatch.setenv("FAKE_MPS_SERVERS", json.dumps({"4100": [4242]}))
    manager.start(GPU_A)
    manager.set_server_limits(GPU_A, 50, 20_000)
    assert control_log(manager, GPU_A)[1:] == [
        "Cmd:set_default_active_thread_percentage 50",
        "Cmd:set_default_device_pinned_mem_limit 0 20000M",
        "Cmd:get_server_list",
        "Cmd:set_active_thread_percentage 4100 50",
        "Cmd:set_device_pinned_mem_limit 4100 0 20000M",
    ]
    with pytest.raises(MpsError, match=r"1\.\.100, not 101"):
        manager.set_server_limits(GPU_A, 101, 1)
    manager.stop(GPU_A)


class FakeSystemd:
    """``systemd-run`` and ``systemctl show -p MainPID``, emulated: a unit runs its command
    with its ``--setenv`` alone, and its main pid is the process ``Type=forking`` leaves
    behind, which systemd itself tracks (here: found once, the first time it is asked for,
    through the daemon's pid file, before any test touches it)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.main_pids: dict[str, int] = {}  # unit -> main pid
        self.pid_files: dict[str, Path] = {}  # unit -> its daemon's pid file, until read once

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        self.calls.append(list(argv))
        if argv[:2] == ["systemctl", "show"]:
            assert argv[2:5] == ["-p", "MainPID", "--value"], argv
            unit = argv[5]
            pid_file = self.pid_files.get(unit)
            if pid_file is not None and pid_file.exists():
                self.main_pids[unit] = int(pid_file.read_text())
                del self.pid_files[unit]
            pid = self.main_pids.get(unit, 0)
            pid = pid if pid and _alive(pid) else 0
            return subprocess.CompletedProcess(argv, 0, f"{pid}\n", "")
        if argv[0] != "systemd-run":
            return subprocess.run(argv, **kwargs)
        split = argv.index("--")
        env = dict(arg.removeprefix("--setenv=").split("=", 1) for arg in argv[:split] if "--setenv=" in arg)
        env["PATH"] = os.environ["PATH"]
        result = subprocess.run(argv[split + 1 :], **{**kwargs, "env": env})
        if result.returncode == 0:
            unit = next(arg.removeprefix("--unit=") for arg in argv if arg.startswith("--unit="))
            self.main_pids.pop(unit, None)
            self.pid_files[unit] = Path(env["CUDA_MPS_PIPE_DIRECTORY"], PID_FILE)
        return result


def test_under_systemd_each_daemon_is_a_unit_of_its_own_with_only_its_environment(
    var_dir: Path, control_binary: Path, monkeypatch: pytest.MonkeyPatch, modes: NvmlBackend
) -> None:
    """Finding 4: daemons started by the agent stayed in its service's cgroup, and every
    agent stop or restart (KillMode=mixed) killed them and the servers under running
    sandboxes. Here systemd-run is emulated: it runs the command with --setenv alone."""
    systemd = FakeSystemd()
    monkeypatch.setenv("FAKE_MPS_FAIL", "")  # the agent's environment does not reach the unit
    manager = MpsManager(
        var_dir / "mps", control_binary=str(control_binary), runner=systemd, systemd=True, compute_modes=modes
    )
    assert manager.start(GPU_A) is True
    key = device_key(GPU_A)
    calls = systemd.calls
    assert calls[0] == ["systemctl", "show", "-p", "MainPID", "--value", f"gpushare-mps-{key}.service"]
    assert calls[1] == [
        "systemd-run",
        f"--unit=gpushare-mps-{key}.service",
        f"--description=gpushare MPS control daemon of {GPU_A}",
        "--collect",
        "--quiet",
        "--property=Type=forking",
        f"--setenv=CUDA_VISIBLE_DEVICES={GPU_A}",
        f"--setenv=CUDA_MPS_PIPE_DIRECTORY={manager.pipe_dir(GPU_A)}",
        f"--setenv=CUDA_MPS_LOG_DIRECTORY={manager.log_dir(GPU_A)}",
        "--",
        str(control_binary),
        "-d",
    ]
    assert manager.running(GPU_A)
    manager.stop(GPU_A)
    assert calls[-1] == [str(control_binary)]  # quit goes through the control socket as before


def test_a_restarted_agent_adopts_a_daemon_that_answers_and_refuses_one_that_does_not(
    manager: MpsManager, control_binary: Path, modes: NvmlBackend
) -> None:
    manager.start(GPU_A)
    again = MpsManager(manager.root, control_binary=str(control_binary), compute_modes=modes)
    assert again.start(GPU_A) is False and again.start(GPU_A) is False
    log = control_log(manager, GPU_A)
    assert [line for line in log if line.startswith("START")] == [log[0]]
    assert log.count("Cmd:get_server_list") == 1  # asked once, on adoption
    again.stop(GPU_A)

    # The recorded daemon (root-only state) is a live process with no control socket: a
    # daemon that hangs. A restarted agent refuses it rather than send shares to it.
    hung = subprocess.Popen(["sleep", "60"])
    try:
        state = manager.root / device_key(GPU_B) / mps.STATE_DIR
        state.mkdir(parents=True)
        (state / mps.DAEMON_STATE).write_text(f"{hung.pid} {_start_time(hung.pid)}\n")
        fresh = MpsManager(manager.root, control_binary=str(control_binary), compute_modes=modes)
        with pytest.raises(MpsError, match=f"daemon {hung.pid} of {GPU_B} does not answer.*kill {hung.pid}"):
            fresh.start(GPU_B)
    finally:
        hung.kill()
        hung.wait()


def test_the_agent_unit_loads_nvidia_uvm_before_its_hardening_forbids_it() -> None:
    """Review §7: ProtectKernelModules=yes stops the agent and everything it starts (an MPS
    server's nvidia-modprobe included) from loading nvidia-uvm; the unit loads it first, with
    full privileges, and keeps no RuntimeDirectory= that a stop would remove under the
    daemons' pipe directories."""
    unit = (Path(__file__).parents[2] / "deploy" / "systemd" / "gpushare-agent.service").read_text()
    settings = [line.partition("=") for line in unit.splitlines() if line and not line.startswith("#")]
    pre = [value for key, _, value in settings if key == "ExecStartPre"]
    assert any(v.lstrip("-@:").startswith("+") and "nvidia-modprobe -u -c 0" in v for v in pre), pre
    assert ("ProtectKernelModules", "=", "yes") in settings
    assert not any(key == "RuntimeDirectory" for key, _, _ in settings)
