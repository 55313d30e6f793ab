"""Finding 4 of the outside probe, replayed inside real bubblewrap sandboxes: ``unshare -Urnm``
gave a full capability set in a nested user namespace (tmpfs mounts and ``iptables-nft -L``
worked), no seccomp filter applied, the web terminal's shell ran with ``NoNewPrivs: 0`` and
a full bounding set, and MPS sandboxes of different users ran as host uid 1000."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.engines import require_engine
from wire import uids
from wire.spec import MpsShare, SandboxHandle, SandboxSpec
from workers.drivers.process import ProcessDriver, bwrap_available

pytestmark = pytest.mark.bwrap
PROBE = (
    "grep -E '^(NoNewPrivs|Seccomp|CapBnd|CapEff):' /proc/self/status;"
    " unshare -U true 2>/dev/null; echo unshare-user=$?;"
    " unshare -Urnm sh -c 'mount -t tmpfs none /tmp' 2>/dev/null; echo unshare-mount=$?;"
    " iptables-nft -L >/dev/null 2>&1; echo iptables=$?;"
    # keyctl(KEYCTL_GET_KEYRING_ID), perf_event_open, bpf: denied by the filter with EPERM (1).
    " python3 -c 'import ctypes, os; libc = ctypes.CDLL(None, use_errno=True);"
    ' print("keyctl", libc.syscall(250, 0, -3, 0), ctypes.get_errno());'
    ' print("bpf", libc.syscall(321, 0, 0, 0), ctypes.get_errno())\';'
    " echo uid=$(id -u); echo PROBE-DONE"
)


def spec(sandbox_id: int, command: str = PROBE, **extra: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": f"c{uuid.uuid4().hex[:12]}", "sandbox_id": sandbox_id, "host": "h1",
        "project": "p", "owner": "o", "image": "", "command": ("sh", "-c", command),
        "device_uuids": ("GPU-aaaa",), "real_gpu": False, "memory_limit_mib": 256, "pids_limit": 32,
    }  # fmt: skip
    values.update(extra)
    return SandboxSpec(**values)  # type: ignore[arg-type]


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[ProcessDriver]:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    made = ProcessDriver(tmp_path / "state", host="h1")
    yield made
    for handle in made.list_owned():
        made.stop(handle, grace_s=0)


def output_of(driver: ProcessDriver, handle: SandboxHandle, until: str = "PROBE-DONE") -> str:
    deadline = time.monotonic() + 30
    text = ""
    while until not in text and time.monotonic() < deadline:
        text = driver.read_output(handle, 0, 65536).data.decode(errors="replace")
        time.sleep(0.05)
    return text


def assert_confined(text: str) -> None:
    assert re.search(r"NoNewPrivs:\s+1", text), text
    assert re.search(r"Seccomp:\s+2", text), text  # a filter is loaded
    assert re.search(r"CapBnd:\s+0+\n", text) and re.search(r"CapEff:\s+0+\n", text), text
    assert "unshare-user=0" not in text and "unshare-mount=0" not in text, text
    assert "iptables=0" not in text, text
    assert "keyctl -1 1" in text and "bpf -1 1" in text, text  # EPERM from the filter


def test_a_batch_gets_no_nested_user_namespace_and_a_seccomp_filter(driver: ProcessDriver) -> None:
    require_engine(shutil.which("python3") is not None, "python3 on the host's /usr")
    handle = driver.launch(spec(101))
    assert_confined(output_of(driver, handle))


def test_the_terminal_gets_the_batchs_confinement(driver: ProcessDriver) -> None:
    handle = driver.launch(spec(102, command="sleep 300"))
    terminal = driver.exec_terminal(handle)
    try:
        terminal.write((PROBE + "\n").encode())
        text, deadline = "", time.monotonic() + 30
        while text.count("PROBE-DONE") < 2 and time.monotonic() < deadline:  # the echo, then the run
            text += terminal.read(0.2).decode(errors="replace")
        assert_confined(text.replace("\r", ""))
        assert f"uid={uids.SANDBOX_UID_BASE}" not in text  # inside, the sandbox's user is 1000
        assert "uid=1000" in text
    finally:
        terminal.close()


def host_uid(handle: SandboxHandle, driver: ProcessDriver) -> int:
    """The host uid the sandbox's command runs as."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        members = [p for p in driver.pids(handle) if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"]
        if members:
            return int(Path(f"/proc/{members[0]}/status").read_text().split("Uid:")[1].split()[0])
        time.sleep(0.05)
    raise AssertionError("no sleep process in the sandbox")


def test_each_sandbox_runs_as_its_own_uid_that_no_host_account_has(driver: ProcessDriver) -> None:
    if os.geteuid() != 0:
        pytest.skip("an agent not running as root runs sandboxes as its own uid")
    accounts = {int(line.split(":")[2]) for line in Path("/etc/passwd").read_text().splitlines() if line}
    one = host_uid(driver.launch(spec(201, command="sleep 300")), driver)
    two = host_uid(driver.launch(spec(202, command="sleep 300")), driver)
    assert one != two and {one, two}.isdisjoint(accounts | {1000}), (one, two)
    assert uids.check_range() is None


def test_mps_shares_of_one_gpu_share_a_private_uid_not_1000(driver: ProcessDriver) -> None:
    if os.geteuid() != 0:
        pytest.skip("an agent not running as root runs sandboxes as its own uid")
    # Where the agent keeps them (workers/gpu/mps.py): every directory above traversable.
    root = Path(tempfile.mkdtemp(prefix="gpushare-mps-", dir="/tmp"))
    pipe = root / "GPU-aaaa" / "pipe"
    pipe.mkdir(parents=True)
    for directory in (pipe, pipe.parent, root):
        directory.chmod(0o755)
    share = MpsShare(pipe_dir=str(pipe), thread_pct=25, memory_mib=1024)
    alice = host_uid(driver.launch(spec(301, command="sleep 300", mps=share)), driver)
    bob = host_uid(driver.launch(spec(302, command="sleep 300", mps=share)), driver)
    other_gpu = uids.mps_uid("GPU-bbbb")
    assert alice == bob == uids.mps_uid("GPU-aaaa") != other_gpu
    assert alice != 1000 and alice >= uids.SANDBOX_UID_BASE
    for handle in driver.list_owned():
        driver.stop(handle, grace_s=0)
    shutil.rmtree(root)


def test_a_uid_range_used_by_a_host_account_is_refused(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(
        f"root:x:0:0::/root:/bin/sh\nsvc:x:{uids.SANDBOX_UID_BASE + 5}:1::/:/bin/false\n"
    )
    (etc / "subuid").write_text("")
    assert "inside the sandbox uid range" in (uids.check_range(etc) or "")
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (etc / "subuid").write_text(f"alice:{uids.SANDBOX_UID_BASE - 10}:65536\n")
    assert "subuid" in (uids.check_range(etc) or "")
