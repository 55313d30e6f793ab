"""Process driver: bubblewrap confinement, cgroup or rlimit limits, restart recovery."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.workers.engines import require_engine
from wire import uids
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from workers.drivers import DriverUnavailable, base, make_driver
from workers.drivers.base import DriverError, require_mps_pipe
from workers.drivers.cgroups import cgroup_mounts
from workers.drivers.gpu_nodes import GpuNodes
from workers.drivers.process import ProcessDriver, bwrap_available, bwrap_problem
from workers.drivers.process_terminal import ProcessTerminal
from workers.gpu.nvml_session import DeviceIds

READY = "READY"


def make_spec(host: str = "h1", **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": f"t{uuid.uuid4().hex[:12]}",
        # Distinct ids: each sandbox runs as its own host uid, and RLIMIT_NPROC counts it.
        "sandbox_id": random.randrange(1, 10**6),
        "host": host,
        "project": "proj",
        "owner": "alice",
        "image": "",
        "command": ("sh", "-c", f"echo {READY}; exec sleep 300"),
        "device_uuids": ("GPU-aaaa",),
        "real_gpu": False,
        "cpu_limit": 0.5,
        "memory_limit_mib": 128,
        "pids_limit": 16,
        "env": {"FOO": "bar"},
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


# --- no engine needed --------------------------------------------------------------------


@pytest.fixture
def fake_gpu_host() -> Iterator[GpuNodes]:
    """A /dev with two GPUs' nodes (minors 0 and 3) and a MIG instance's caps on GPU 3, in a
    directory the sandbox's unprivileged uid can reach (bwrap binds them as that uid)."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-dev-"))
    root.chmod(0o755)
    dev, proc = root / "dev", root / "proc"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in (
        "nvidiactl",
        "nvidia-uvm",
        "nvidia0",
        "nvidia3",
        *(f"nvidia-caps/nvidia-cap{c}" for c in (1, 21, 22)),
    ):
        (dev / name).write_text(name)
    for access, minor in (("gi1/access", 21), ("gi1/ci0/access", 22)):
        path = proc / "capabilities" / "gpu3" / "mig" / access
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
    ids = {"GPU-aaaa": DeviceIds(0), "GPU-bbbb": DeviceIds(3), "MIG-cccc": DeviceIds(3, gi=1, ci=0)}
    yield GpuNodes(proc_root=proc, dev_root=dev, nvml=ids.__getitem__)
    shutil.rmtree(root)


def options_of(argv: list[str], option: str) -> list[tuple[str, ...]]:
    return [tuple(argv[i + 1 : i + 3]) for i, arg in enumerate(argv) if arg == option]


def test_a_mig_sandbox_binds_its_parent_and_its_two_caps_only(
    tmp_path: Path, fake_gpu_host: GpuNodes
) -> None:
    """Before, a MIG sandbox got every /dev/nvidiaN and all of /dev/nvidia-caps, isolated only
    by CUDA_VISIBLE_DEVICES; and nodes were bound with --dev-bind-try, a missing one skipped."""
    driver = ProcessDriver(tmp_path, gpu_nodes=fake_gpu_host)
    argv = driver._bwrap_args(make_spec(device_uuids=("MIG-cccc",), real_gpu=True), 3, 4, 5, 6)
    dev = fake_gpu_host.dev_root
    assert options_of(argv, "--dev-bind") == [
        (str(dev / name), f"/dev/{name}")
        for name in (
            "nvidiactl",
            "nvidia-uvm",
            "nvidia3",
            "nvidia-caps/nvidia-cap21",
            "nvidia-caps/nvidia-cap22",
        )
    ]
    assert "--dev-bind-try" not in argv
    dedicated = driver._bwrap_args(make_spec(device_uuids=("GPU-aaaa",), real_gpu=True), 3, 4, 5, 6)
    assert [target for _, target in options_of(dedicated, "--dev-bind")][-1] == "/dev/nvidia0"
    assert ("/sys", "/sys") in options_of(dedicated, "--ro-bind")
    # Simulated GPUs (real_gpu false) get no node, whatever they are called.
    assert options_of(driver._bwrap_args(make_spec(), 3, 4, 5, 6), "--dev-bind") == []


def test_a_missing_node_fails_the_launch_and_leaves_nothing(tmp_path: Path, fake_gpu_host: GpuNodes) -> None:
    (fake_gpu_host.dev_root / "nvidia-uvm").unlink()
    driver = ProcessDriver(tmp_path / "state", gpu_nodes=fake_gpu_host)
    with pytest.raises(DriverError, match=r"/dev/nvidia-uvm is missing.*nvidia-modprobe -u -c 0"):
        driver.launch(make_spec(real_gpu=True))
    assert driver.list_owned() == [] and not list(driver.state_dir.glob("t*"))


def test_dev_shm_is_the_tiers_size(tmp_path: Path) -> None:
    driver = ProcessDriver(tmp_path)
    argv = driver._bwrap_args(make_spec(shm_size_mib=2048), 3, 4, 5, 6)
    at = argv.index("/dev/shm")
    assert argv[at - 5 : at] == ["--size", str(2048 * 2**20), "--perms", "1777", "--tmpfs"]
    # Old messages (no size): the same size as /tmp's.
    argv = driver._bwrap_args(make_spec(memory_limit_mib=400), 3, 4, 5, 6)
    assert argv[argv.index("/dev/shm") - 4] == str(100 * 2**20)


def test_a_gpu_sandbox_keeps_the_agents_driver_library_path(
    tmp_path: Path, fake_gpu_host: GpuNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose libcuda is found through LD_LIBRARY_PATH (a containerised driver) gave
    GPU sandboxes "CUDA driver version is insufficient" under --clearenv."""
    libs = tmp_path / "run" / "nvidia" / "driver" / "lib"
    libs.mkdir(parents=True)
    value = f"{libs}:/usr/lib/x86_64-linux-gnu:relative:/etc:/home/dev/lib:/nonexistent:/"
    monkeypatch.setenv("LD_LIBRARY_PATH", value)
    driver = ProcessDriver(tmp_path, gpu_nodes=fake_gpu_host)
    argv = driver._bwrap_args(make_spec(real_gpu=True), 3, 4, 5, 6)
    assert ("LD_LIBRARY_PATH", f"{libs}:/usr/lib/x86_64-linux-gnu") in options_of(argv, "--setenv")
    assert (str(libs), str(libs)) in options_of(argv, "--ro-bind")  # /usr is bound already
    assert not [s for s, _ in options_of(argv, "--ro-bind") if s.startswith("/usr/lib")]
    # Nothing of it for a sandbox without a GPU.
    cpu = driver._bwrap_args(make_spec(device_uuids=(), real_gpu=True), 3, 4, 5, 6)
    assert "LD_LIBRARY_PATH" not in cpu and str(libs) not in cpu


@pytest.mark.parametrize("real_gpu", [False, True])
def test_an_mps_share_that_could_not_reach_its_daemon_is_refused(
    tmp_path: Path, fake_gpu_host: GpuNodes, real_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA that cannot connect to the daemon runs silently without MPS: no limits at all."""
    monkeypatch.setattr(base, "MPS_SOCKET_WAIT_S", 0.2)
    driver = ProcessDriver(tmp_path / "state", gpu_nodes=fake_gpu_host)
    pipe = Path(tempfile.mkdtemp(prefix="gpushare-mps-"))
    try:
        share = MpsShare(pipe_dir=str(pipe / "absent"), thread_pct=25, memory_mib=1024)
        with pytest.raises(DriverError, match=r"absent is missing.*MPS daemon is not running"):
            driver.launch(make_spec(mps=share, real_gpu=real_gpu))
        share = MpsShare(pipe_dir=str(pipe), thread_pct=25, memory_mib=1024)
        if os.geteuid() == 0:  # 0700, root's: the sandbox's uid cannot enter it
            with pytest.raises(DriverError, match=r"cannot be entered by the sandbox's uid \d+"):
                driver.launch(make_spec(mps=share, real_gpu=real_gpu))
            # As the agent's MpsManager makes it: root's, the GPU's MPS group, 1770 (sticky).
            os.chown(pipe, 0, uids.mps_uid("GPU-aaaa"))
            os.chmod(pipe, 0o1770)  # noqa: S103 - the MPS group's, sticky: as the agent makes it
        uid = uids.mps_uid("GPU-aaaa") if os.geteuid() == 0 else os.geteuid()
        if real_gpu:  # the directory, but no daemon's socket in it
            with pytest.raises(DriverError, match="control is missing"):
                driver.launch(make_spec(mps=share, real_gpu=real_gpu))
            with socket.socket(socket.AF_UNIX) as control:
                control.bind(str(pipe / "control"))
                (pipe / "control").chmod(0o755)
                if os.geteuid() == 0:  # connect() needs write permission on the socket
                    with pytest.raises(DriverError, match="not a socket the sandbox's uid"):
                        require_mps_pipe(str(pipe), uid, real_gpu=True)
                (pipe / "control").chmod(0o777)  # as the daemon makes it
                require_mps_pipe(str(pipe), uid, real_gpu=True)
        require_mps_pipe(str(pipe), uid, real_gpu=False)
        assert driver.list_owned() == []
        if real_gpu:  # a daemon counted up by its pid file may make its socket a moment later
            later = pipe / "later"
            later.mkdir()
            later.chmod(0o777)
            late = socket.socket(socket.AF_UNIX)

            def daemon_comes_up() -> None:
                late.bind(str(later / "control"))
                time.sleep(0.3)  # bound with the umask's mode, widened a moment later
                (later / "control").chmod(0o777)  # as the daemon makes it

            timer = threading.Timer(0.1, daemon_comes_up)
            timer.start()
            try:
                require_mps_pipe(str(later), uid, real_gpu=True, socket_wait_s=5.0)
            finally:
                timer.join()
                late.close()
    finally:
        shutil.rmtree(pipe)


def test_bwrap_is_probed_as_the_unprivileged_uid_it_runs_as(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that lets only root make user namespaces (Ubuntu 24.04's AppArmor restriction):
    the probe ran bwrap as root and passed, then every launch (as the sandbox's uid) failed."""
    if os.geteuid() != 0:
        pytest.skip("launches drop to another uid only under a root agent")
    fake = Path(tempfile.mkdtemp(prefix="gpushare-bwrap-"))
    try:
        fake.chmod(0o755)
        (fake / "bwrap").write_text(
            '#!/bin/sh\n[ "$(id -u)" = 0 ] && exit 0\n'
            'echo "bwrap: setting up uid map: Permission denied" >&2; exit 1\n'
        )
        (fake / "bwrap").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
        problem = bwrap_problem()
        assert problem is not None and "uid map: Permission denied" in problem, problem
        assert f"as uid {uids.sandbox_uid(0)}" in problem
        assert not bwrap_available()
        with pytest.raises(DriverUnavailable) as unavailable:
            make_driver("process", "h1", fake / "state")
        assert "apparmor_restrict_unprivileged_userns" in unavailable.value.remedy
    finally:
        shutil.rmtree(fake)


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'cgroups'"):
        ProcessDriver(tmp_path, limits="cgroups")
    driver = ProcessDriver(tmp_path)
    with pytest.raises(DriverError, match="not safe as a file name"):
        driver.launch(make_spec(allocation_key="../escape"))
    with pytest.raises(DriverError, match="needs a command"):
        driver.launch(make_spec(command=()))


def test_unknown_sandbox_is_missing(tmp_path: Path) -> None:
    driver = ProcessDriver(tmp_path)
    handle = SandboxHandle(driver="process", allocation_key="nope", sandbox_id=1, ref="1")
    assert driver.status(handle).state == "missing"
    driver.stop(handle)  # nothing to stop: no error
    with pytest.raises(DriverError, match="not running"):
        driver.exec_terminal(handle)


# --- with bubblewrap ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bwrap() -> None:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")


@pytest.fixture(params=["auto", "rlimit"])
def driver(request: pytest.FixtureRequest, bwrap: None, tmp_path: Path) -> Iterator[ProcessDriver]:
    proc_driver = ProcessDriver(tmp_path / "state", host="h1", limits=request.param)
    yield proc_driver
    for handle in ProcessDriver(tmp_path / "state").list_owned():
        proc_driver.stop(handle, grace_s=0)


def log_of(driver: ProcessDriver, handle: SandboxHandle) -> str:
    return driver.read_output(handle, 0, 1 << 20).data.decode(errors="replace")


def wait_for_log(driver: ProcessDriver, handle: SandboxHandle, text: str) -> str:
    deadline = time.monotonic() + 10
    while text not in log_of(driver, handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = log_of(driver, handle)
    assert text in out, out
    return out


def wait_until_exited(driver: ProcessDriver, handle: SandboxHandle) -> None:
    deadline = time.monotonic() + 10
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.05)


def sandbox_pids(handle: SandboxHandle) -> list[int]:
    """Host pids of the wrapper's descendants that live in the sandbox's pid namespace."""
    wrapper = int(handle.ref)
    host_ns = os.readlink(f"/proc/{wrapper}/ns/pid")
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            match = re.search(r"^PPid:\s+(\d+)", status, re.M)
            parents[int(entry.name)] = int(match.group(1)) if match else 0
    found = []
    for pid in parents:
        ancestor = parents[pid]
        while ancestor not in (0, 1, wrapper):
            ancestor = parents.get(ancestor, 0)
        try:
            if ancestor == wrapper and os.readlink(f"/proc/{pid}/ns/pid") != host_ns:
                found.append(pid)
        except OSError:
            continue
    return found


def gone(pid: int) -> bool:
    """No such process, or only a zombie (its parent may be an init that reaps lazily)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


def command_pid(handle: SandboxHandle) -> int:
    """The ``sleep 300`` the test command ends in."""
    for pid in sandbox_pids(handle):
        if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00300\x00":
            return pid
    raise AssertionError("the sandbox's command is not running")


@pytest.mark.bwrap
def test_launch_confines_the_command(driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_HOST_SECRET", "leak")
    script = (
        "id -u; echo host=$(hostname); env; "
        "touch /usr/x 2>&1; ls /root 2>&1; tail -n +3 /proc/net/dev | cut -d: -f1; "
        "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; "
        f"cd && touch ok && echo home-ok; echo {READY}; exec sleep 300"
    )
    spec = make_spec(sandbox_id=42, command=("sh", "-c", script))
    handle = driver.launch(spec)
    assert handle.allocation_key == spec.allocation_key and handle.driver == "process"
    status = driver.status(handle)
    assert status.state == "running" and status.started_at_ms is not None
    out = wait_for_log(driver, handle, READY)
    lines = out.splitlines()
    assert lines[0] == "1000"
    assert "host=sandbox-42" in lines
    assert "FOO=bar" in lines
    assert "NVIDIA_VISIBLE_DEVICES=GPU-aaaa" in lines
    assert "HOME=/home/sandbox" in lines
    assert not any("GPUSHARE_HOST_SECRET" in line for line in lines)  # --clearenv
    assert "Read-only file system" in out
    assert "/root" in out and "No such file" in out  # the host's /root is not there
    assert [line.strip() for line in lines if line.strip() in ("lo", "eth0")] == ["lo"]
    assert re.search(r"CapEff:\s+0+\n", out)
    assert re.search(r"NoNewPrivs:\s+1", out)
    assert "home-ok" in lines
    # Outside, the sandbox is an unprivileged host uid of its own, never root.
    host_uids = Path(f"/proc/{command_pid(handle)}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", host_uids, re.M).group(1))  # type: ignore[union-attr]
    assert uid != 0
    if os.geteuid() == 0:
        assert uid not in (1000, 65534)  # per-sandbox, not shared with other sandboxes


@pytest.mark.bwrap
def test_a_cpu_only_sandbox_runs_with_no_gpu_node(driver: ProcessDriver, tmp_path: Path) -> None:
    """No device named: no /dev/nvidia* bind (without UUIDs the node lookup would bind every
    GPU node), no sysfs, and variables that name no device; it runs as any sandbox does."""
    gpus = tmp_path / "gpus" / "0000:01:00.0"
    gpus.mkdir(parents=True)
    gpus.joinpath("information").write_text("GPU UUID: \t GPU-aaaa\nDevice Minor: \t 0\n")
    nodes = GpuNodes(proc_root=tmp_path, nvml=None)
    confined = ProcessDriver(driver.state_dir, host="h1", limits=driver.limits, gpu_nodes=nodes)
    script = f"env; echo nodes=$(ls /dev | grep -c nvidia); echo {READY}; exec sleep 300"
    spec = make_spec(device_uuids=(), real_gpu=True, command=("sh", "-c", script))
    argv = confined._bwrap_args(spec, 3, 4, 5, 6)
    assert not any(arg.startswith("/dev/nvidia") or arg == "/sys" for arg in argv), argv
    handle = confined.launch(spec)
    lines = wait_for_log(confined, handle, READY).splitlines()
    assert "NVIDIA_VISIBLE_DEVICES=void" in lines and "CUDA_VISIBLE_DEVICES=" in lines
    assert "nodes=0" in lines
    assert confined.status(handle).state == "running"
    confined.stop(handle, grace_s=0)
    assert confined.status(handle).state == "missing"


@pytest.mark.bwrap
def test_launch_is_idempotent(driver: ProcessDriver) -> None:
    spec = make_spec()
    first = driver.launch(spec)
    wait_for_log(driver, first, READY)
    assert driver.launch(spec) == first
    assert len(sandbox_pids(first)) == 2  # bwrap's init and the command: one sandbox
    assert len(list(driver.state_dir.glob("*.json"))) == 1
    # Exited sandboxes are found too: the exit code stays readable until stop().
    done = driver.launch(make_spec(command=("sh", "-c", "exit 3")))
    wait_until_exited(driver, done)
    status = driver.status(done)
    assert (status.state, status.exit_code) == ("exited", 3)
    assert driver.launch(make_spec(allocation_key=done.allocation_key)) == done


@pytest.mark.bwrap
def test_concurrent_launches_and_stops(driver: ProcessDriver) -> None:
    spec = make_spec()

    def twin() -> ProcessDriver:  # another agent process sharing the state directory
        return ProcessDriver(driver.state_dir, host="h1", limits=driver.limits)

    with ThreadPoolExecutor(4) as pool:
        handles = set(pool.map(lambda _: twin().launch(spec), range(4)))
    assert len(handles) == 1
    (handle,) = handles
    assert len(sandbox_pids(handle)) == 2
    # A long grace period for one sandbox does not hold up launching another.
    stubborn = driver.launch(make_spec(command=("sh", "-c", "trap '' TERM; sleep 300")))
    with ThreadPoolExecutor(4) as pool:
        stops = [pool.submit(twin().stop, stubborn, 3) for _ in range(3)]
        time.sleep(0.5)
        started = time.monotonic()
        other = driver.launch(make_spec())
        assert time.monotonic() - started < 2
        for future in stops:
            future.result()
    assert driver.status(stubborn).state == "missing"
    assert driver.status(other).state == "running"


@pytest.mark.bwrap
def test_limits_are_applied(driver: ProcessDriver) -> None:
    spec = make_spec(memory_limit_mib=96, cpu_limit=0.25, pids_limit=12)
    handle = driver.launch(spec)
    wait_for_log(driver, handle, READY)
    pid = command_pid(handle)
    limits = Path(f"/proc/{pid}/limits").read_text()
    cgroups = {
        line.split(":", 2)[1]: line.split(":", 2)[2]
        for line in Path(f"/proc/{int(handle.ref)}/cgroup").read_text().splitlines()
    }
    in_cgroup = any(spec.allocation_key in path for path in cgroups.values())
    if driver.limits == "rlimit" or not in_cgroup:
        assert driver.limits == "rlimit", "auto found no usable cgroups on this host"
        assert re.search(rf"Max address space\s+{96 * 2**20}\s", limits), limits
        assert re.search(r"Max processes\s+15\s", limits), limits  # + wrapper, bwrap x2
    else:
        v2, v1 = cgroup_mounts()
        if v2 is not None:
            unified = Path(v2 + cgroups[""])
            assert (unified / "memory.max").read_text().strip() == str(96 * 2**20)
            assert (unified / "cpu.max").read_text().split() == ["25000", "100000"]
            assert (unified / "pids.max").read_text().strip() == "15"
        else:

            def leaf(controller: str) -> Path:
                key = next(k for k in cgroups if controller in k.split(","))
                return Path(v1[controller] + cgroups[key])

            memory = leaf("memory") / "memory.limit_in_bytes"
            assert memory.read_text().strip() == str(96 * 2**20)
            assert (leaf("cpu") / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (leaf("cpu") / "cpu.cfs_period_us").read_text().strip() == "100000"
            assert (leaf("pids") / "pids.max").read_text().strip() == "15"
        # Every sandbox process is inside the limits, the command included.
        assert spec.allocation_key in Path(f"/proc/{pid}/cgroup").read_text()


@pytest.mark.bwrap
def test_pids_limit_stops_a_fork_bomb(driver: ProcessDriver) -> None:
    # No command substitution: the shell must not need a fork before the loop starts.
    script = "i=0; while [ $i -lt 40 ]; do sleep 30 & i=$((i+1)); echo spawned; done"
    handle = driver.launch(make_spec(pids_limit=8, command=("sh", "-c", script)))
    out = wait_for_log(driver, handle, "fork")
    assert "Cannot fork" in out or "Resource temporarily unavailable" in out, out
    assert 0 < out.count("spawned") <= 8  # the shell itself holds one of the eight


@pytest.mark.bwrap
def test_mps_pipe_dir_and_env(driver: ProcessDriver) -> None:
    with tempfile.TemporaryDirectory(prefix="gpushare-mps-") as pipe_dir:
        os.chmod(pipe_dir, 0o777)  # noqa: S103 - the MPS client (another uid) must reach it
        mps = MpsShare(pipe_dir=pipe_dir, thread_pct=30, memory_mib=2048)
        script = f'touch "$CUDA_MPS_PIPE_DIRECTORY/client" && env; echo {READY}; exec sleep 300'
        handle = driver.launch(make_spec(mps=mps, command=("sh", "-c", script)))
        lines = wait_for_log(driver, handle, READY).splitlines()
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}" in lines
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in lines
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M" in lines
        assert (Path(pipe_dir) / "client").exists()  # bound read-write
        driver.stop(handle, grace_s=0)


@pytest.mark.bwrap
def test_failed_start_is_an_error_and_leaves_nothing(driver: ProcessDriver) -> None:
    with pytest.raises(DriverError, match=r"failed to start.*nonexistent"):
        driver.launch(make_spec(command=("/nonexistent/command",)))
    assert driver.list_owned() == []
    assert not list(driver.state_dir.glob("t*"))


@pytest.mark.bwrap
def test_a_warning_signals_the_command_and_leaves_the_sandbox(driver: ProcessDriver) -> None:
    handle = driver.launch(
        make_spec(
            command=(
                "sh",
                "-c",
                f"trap 'echo got-term; exit 3' TERM; echo {READY}; while :; do sleep 0.2; done",
            )
        )
    )
    wait_for_log(driver, handle, READY)
    assert driver.warn(handle).startswith("SIGTERM sent to its")
    wait_until_exited(driver, handle)
    assert driver.status(handle).exit_code == 3  # its trap ran: it could save its work
    assert "got-term" in log_of(driver, handle)
    assert driver.warn(handle) == "the sandbox is no longer running"


@pytest.mark.bwrap
def test_stop_is_graceful_then_forceful_and_idempotent(driver: ProcessDriver) -> None:
    polite = driver.launch(make_spec(command=("sh", "-c", f"echo {READY}; exec sleep 300")))
    stubborn = driver.launch(
        make_spec(command=("sh", "-c", f"trap '' TERM; echo {READY}; while :; do sleep 1; done"))
    )
    for handle in (polite, stubborn):
        wait_for_log(driver, handle, READY)
    inside = sandbox_pids(polite)
    started = time.monotonic()
    driver.stop(polite, grace_s=10)
    assert time.monotonic() - started < 5  # SIGTERM reached the command: no grace wait
    started = time.monotonic()
    driver.stop(stubborn, grace_s=1)
    assert 1 <= time.monotonic() - started < 5  # ignored SIGTERM: killed after the grace
    for handle in (polite, stubborn):
        assert driver.status(handle).state == "missing"
        assert gone(int(handle.ref))
        driver.stop(handle)  # again: no error
    assert all(gone(pid) for pid in inside)
    assert list(driver.state_dir.glob("t*")) == []
    v2, v1 = cgroup_mounts()
    for mount in [v2, *v1.values()]:
        if mount is not None:
            assert not Path(mount, "gpushare", polite.allocation_key).exists()


@pytest.mark.bwrap
def test_list_owned_after_restart(driver: ProcessDriver) -> None:
    handles = {driver.launch(make_spec()) for _ in range(2)}
    restarted = ProcessDriver(driver.state_dir, host="h1", limits=driver.limits)
    assert set(restarted.list_owned()) == handles
    assert ProcessDriver(driver.state_dir, host="other").list_owned() == []
    for handle in handles:
        assert restarted.status(handle).state == "running"
    victim = next(iter(handles))
    restarted.stop(victim, grace_s=2)
    assert set(restarted.list_owned()) == handles - {victim}


@pytest.mark.bwrap
def test_terminal_runs_a_shell_inside(driver: ProcessDriver) -> None:
    handle = driver.launch(make_spec(sandbox_id=42))
    wait_for_log(driver, handle, READY)
    terminal = driver.exec_terminal(handle)
    assert isinstance(terminal, ProcessTerminal)
    try:
        terminal.resize(40, 120)
        terminal.write(b"echo h''i; id -u; echo $FOO; hostname\n")
        out = b""
        deadline = time.monotonic() + 10
        pattern = rb"hi\r?\n1000\r?\nbar\r?\nsandbox-42\r?\n"
        while time.monotonic() < deadline and not re.search(pattern, out):
            out += terminal.read(0.2)
        assert re.search(pattern, out), out
        terminal.write(b"exit\n")
        with pytest.raises(EOFError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                terminal.read(0.2)
    finally:
        terminal.close()


@pytest.mark.bwrap
def test_exceeding_the_memory_limit_kills_the_sandbox_and_says_why(driver: ProcessDriver) -> None:
    # The shell holds 300 MB of output in a variable: far over the 64 MiB limit.
    hog = "a=$(head -c 300000000 /dev/zero | tr '\\0' x); echo survived ${#a}"
    handle = driver.launch(make_spec(memory_limit_mib=64, command=("sh", "-c", hog)))
    deadline = time.monotonic() + 60
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    status = driver.status(handle)
    assert status.state == "exited" and status.exit_code != 0, status
    assert "survived" not in log_of(driver, handle)
    if driver.limits != "rlimit":  # the kernel's OOM killer acted: the cgroup counted it
        assert status.reason == "out of memory: killed at the memory limit", status
    driver.stop(handle, grace_s=0)


@pytest.mark.bwrap
def test_pids_are_the_sandboxes_host_pids(driver: ProcessDriver) -> None:
    handle = driver.launch(make_spec())
    wait_for_log(driver, handle, READY)
    assert command_pid(handle) in driver.pids(handle)
    driver.stop(handle, grace_s=0)
    assert driver.pids(handle) == []


@pytest.mark.bwrap
def test_the_sandbox_sees_exactly_its_gpu_nodes_and_its_shm(
    driver: ProcessDriver, fake_gpu_host: GpuNodes
) -> None:
    confined = ProcessDriver(driver.state_dir, host="h1", limits=driver.limits, gpu_nodes=fake_gpu_host)
    script = (
        "find /dev -name 'nvidia*' | sort; cat /dev/nvidia-caps/nvidia-cap22; echo; "
        f"df -k /dev/shm | tail -1; touch /dev/shm/x && echo shm-writable; echo {READY}; exec sleep 300"
    )
    spec = make_spec(device_uuids=("MIG-cccc",), real_gpu=True, shm_size_mib=48, command=("sh", "-c", script))
    handle = confined.launch(spec)
    lines = wait_for_log(confined, handle, READY).splitlines()
    found = [line for line in lines if line.startswith("/dev/nvidia")]
    assert found == sorted(
        ["/dev/nvidia-caps", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22",
         "/dev/nvidia-uvm", "/dev/nvidia3", "/dev/nvidiactl"]
    ), lines  # fmt: skip
    assert "nvidia-caps/nvidia-cap22" in lines  # the host's node itself, bound
    shm = next(line for line in lines if line.endswith("/dev/shm"))
    assert shm.split()[1] == str(48 * 1024), shm
    assert "shm-writable" in lines
    confined.stop(handle, grace_s=0)


def test_another_drivers_state_file_is_not_taken_for_a_sandbox(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A host whose SANDBOX_DRIVER went from simulated to process keeps the state-only
    driver's file in the same directory: listing skips it, saying so."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "simulated-sandboxes.json").write_text("[]")
    with caplog.at_level(logging.WARNING, logger="workers.drivers.process"):
        assert ProcessDriver(state).list_owned() == []
    assert "not a process sandbox's state" in caplog.text
