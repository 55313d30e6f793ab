"""Process driver: bubblewrap confinement, cgroup or rlimit limits, restart recovery."""

from __future__ import annotations

import os
import random
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.workers.engines import require_engine
from workers.drivers.base import DriverError, MpsShare, SandboxHandle, SandboxSpec
from workers.drivers.cgroups import cgroup_mounts
from workers.drivers.process import ProcessDriver, _gpu_device_nodes, bwrap_available
from workers.drivers.process_terminal import ProcessTerminal

READY = "READY"


def make_spec(host: str = "h1", **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_id": f"t{uuid.uuid4().hex[:12]}",
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


def test_gpu_nodes_by_device_minor(tmp_path: Path) -> None:
    for bus, uuid_, minor in (("0000:01:00.0", "GPU-aaaa", 0), ("0000:02:00.0", "GPU-bbbb", 3)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid_}\nDevice Minor: \t {minor}\n"
        )
    nodes = _gpu_device_nodes(("GPU-bbbb",), tmp_path)
    assert "/dev/nvidia3" in nodes and "/dev/nvidia0" not in nodes
    assert "/dev/nvidiactl" in nodes
    # A MIG device has no minor of its own: every GPU node plus the capability nodes.
    assert "/dev/nvidia-caps" in _gpu_device_nodes(("MIG-cccc",), tmp_path)
    assert _gpu_device_nodes((), tmp_path) == []  # no GPU named (CPU only): no GPU node at all


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'cgroups'"):
        ProcessDriver(tmp_path, limits="cgroups")
    driver = ProcessDriver(tmp_path)
    with pytest.raises(DriverError, match="not safe as a file name"):
        driver.launch(make_spec(allocation_id="../escape"))
    with pytest.raises(DriverError, match="needs a command"):
        driver.launch(make_spec(command=()))


def test_unknown_sandbox_is_missing(tmp_path: Path) -> None:
    driver = ProcessDriver(tmp_path)
    handle = SandboxHandle(driver="process", allocation_id="nope", sandbox_id=1, ref="1")
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
    assert handle.allocation_id == spec.allocation_id and handle.driver == "process"
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
    confined = ProcessDriver(driver.state_dir, host="h1", limits=driver.limits, gpus_dir=gpus.parent)
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
    assert driver.launch(make_spec(allocation_id=done.allocation_id)) == done


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
    in_cgroup = any(spec.allocation_id in path for path in cgroups.values())
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
        assert spec.allocation_id in Path(f"/proc/{pid}/cgroup").read_text()


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
    mps = MpsShare(pipe_dir="/nonexistent/mps", thread_pct=30, memory_mib=2048)
    with pytest.raises(DriverError, match=r"failed to start.*nonexistent"):
        driver.launch(make_spec(mps=mps))
    assert driver.list_owned() == []
    assert not list(driver.state_dir.glob("t*"))


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
            assert not Path(mount, "gpushare", polite.allocation_id).exists()


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
