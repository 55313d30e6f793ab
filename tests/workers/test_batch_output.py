"""A sandbox's output on the host (finding 2 of the outside probe): a batch printing 300 MB
wrote 300 MB to a root-owned file in a second, and its owner never saw a line of it.

Now every driver keeps at most the cap on disk whatever the tenant prints, and reads the
newest of it back from an offset, saying how much it dropped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.workers.engines import require_engine
from wire.spec import SandboxSpec
from workers.drivers.docker_logs import log_config
from workers.drivers.output import read_segments, write_capped
from workers.drivers.process import ProcessDriver, bwrap_available

PRINTED = 300_000_000  # what the probe printed
CAP = 1 << 20  # 1 MiB in these tests (the default is 10 MiB)
LAST = b"the last line\n"


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_the_capped_writer_keeps_the_newest_cap_bytes(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    writer = subprocess.Popen(  # the agent runs it the same way: by path, isolated
        [sys.executable, "-I", "-S", str(Path(write_capped.__code__.co_filename)), str(tmp_path), str(CAP)],
        stdin=read_end,
    )
    os.close(read_end)
    chunk = b"x" * 65536
    for _ in range(PRINTED // len(chunk)):
        os.write(write_end, chunk)
    os.write(write_end, LAST)
    os.close(write_end)
    assert writer.wait(timeout=120) == 0
    total = PRINTED // len(chunk) * len(chunk) + len(LAST)
    assert disk_bytes(tmp_path) <= CAP
    head = read_segments(tmp_path, 0, 1024)
    assert head.start >= total - CAP and head.total == total  # the start was dropped, and says so
    tail = read_segments(tmp_path, total - len(LAST), 1024)
    assert tail.data == LAST and tail.start == total - len(LAST) and tail.end == total
    assert all(oct(p.stat().st_mode)[-3:] == "600" for p in tmp_path.iterdir())  # the agent's only


def test_reads_resume_from_an_offset(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"".join(f"line {n}\n".encode() for n in range(1000)))
    os.close(write_end)
    write_capped(read_end, tmp_path, 1 << 20)
    first = read_segments(tmp_path, 0, 100)
    second = read_segments(tmp_path, first.end, 100)
    assert first.data + second.data == b"".join(f"line {n}\n".encode() for n in range(1000))[:200]
    assert read_segments(tmp_path, 10**9, 100).data == b""


@pytest.mark.bwrap
def test_a_process_sandbox_printing_300_mb_leaves_at_most_the_cap(tmp_path: Path) -> None:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    driver = ProcessDriver(tmp_path / "state", host="h1", output_cap=CAP)
    printing = f"head -c {PRINTED} /dev/zero | tr '\\0' x; printf 'the last line\\n'"
    spec = SandboxSpec(
        allocation_key=f"o{uuid.uuid4().hex[:12]}", sandbox_id=4242, host="h1", project="p", owner="o",
        image="", command=("sh", "-c", printing),
        device_uuids=(), real_gpu=False, memory_limit_mib=256, pids_limit=32, batch=True,
    )  # fmt: skip
    handle = driver.launch(spec)
    deadline = time.monotonic() + 180
    while driver.status(handle).state == "running" and time.monotonic() < deadline:
        assert disk_bytes(tmp_path / "state") <= CAP + 65536, "the output outgrew the cap while running"
        time.sleep(0.2)
    assert driver.status(handle).state == "exited" and driver.status(handle).exit_code == 0
    state = tmp_path / "state"
    output_bytes = sum(p.stat().st_size for p in state.glob("*.output/*"))
    assert output_bytes <= CAP
    wait_total = time.monotonic() + 10
    while read_segments(state / f"{spec.allocation_key}.output", 0, 1).total < PRINTED + len(LAST):
        assert time.monotonic() < wait_total, "the writer did not drain"
        time.sleep(0.1)
    tail = driver.read_output(handle, PRINTED + len(LAST) - 100, 4096)
    assert tail.data.endswith(LAST) and tail.total == PRINTED + len(LAST)
    driver.stop(handle, grace_s=0)
    assert not list(state.glob("*.output"))  # removed with the sandbox


def test_docker_keeps_a_containers_log_to_the_cap() -> None:
    config: Any = log_config(CAP)
    assert config == {"type": "json-file", "config": {"max-size": str(CAP // 2), "max-file": "2"}}


@pytest.mark.docker
def test_a_container_printing_30_mb_leaves_at_most_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.drivers.docker import DockerDriver, docker_available

    require_engine(docker_available(), "a Docker engine")
    monkeypatch.setenv("SANDBOX_OUTPUT_MAX_BYTES", str(CAP))
    driver = DockerDriver(host="h1")
    spec = SandboxSpec(
        allocation_key=f"o{uuid.uuid4().hex[:12]}", sandbox_id=4243, host="h1", project="p", owner="o",
        image="gpushare/sandbox-base:1", device_uuids=(), real_gpu=False, batch=True,
        command=("sh", "-c", "yes 0123456789 | head -c 30000000; printf 'the last line\\n'"),
    )  # fmt: skip
    handle = driver.launch(spec)
    try:
        deadline = time.monotonic() + 120
        while driver.status(handle).state == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        log_path = Path(driver.client.containers.get(handle.ref).attrs["LogPath"])
        on_disk = sum(p.stat().st_size for p in log_path.parent.glob(log_path.name + "*"))
        assert on_disk <= CAP, f"{on_disk} bytes of container log on the host"
        pieces = [driver.read_output(handle, 0, 256 * 1024)]
        while pieces[-1].data:  # follow on, as the agent does, from each piece's end
            pieces.append(driver.read_output(handle, pieces[-1].end, 256 * 1024))
        kept = b"".join(p.data for p in pieces)
        assert kept.endswith(LAST) and 0 < len(kept) <= CAP
    finally:
        driver.stop(handle, grace_s=0)
