"""The device checks' steps that need Python: each prints what a lent H100/H200 answers, for
the issue's note. Read-only as to the GPU's modes: never a MIG, compute-mode, clock, power or
persistence change, never a reset (the MPS daemons it starts are private, compute mode left
alone: ``enforce=False``). Run by scripts/gpu-checks/run.sh as root, from the repo
root, with the client built at $GPUSHARE_CHECK_CLIENT.

    python3 scripts/gpu-checks/checks.py unit|nvml|mps|fault
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import pynvml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# The GPU modules without the Celery app that ``workers/__init__`` loads: a lent machine has
# the driver, CUDA and nvidia-ml-py, not necessarily the platform's whole environment.
_workers = types.ModuleType("workers")
_workers.__path__ = [str(ROOT / "workers")]
sys.modules.setdefault("workers", _workers)

from wire.uids import mps_uid  # noqa: E402
from workers.gpu.mps import MpsManager  # noqa: E402
from workers.gpu.nvml import NvmlBackend  # noqa: E402

CLIENT = os.environ.get("GPUSHARE_CHECK_CLIENT", "/usr/local/bin/gpushare-check-client")
UNIT = ROOT / "deploy/systemd/gpushare-agent.service"
# The [Service] settings of the agent's unit that can close a device node: what the unit
# check runs NVML under, exactly as the unit ships them.
SANDBOXING = re.compile(
    r"^(Protect|Private|NoNewPrivileges|Restrict|Device|LockPersonality|MemoryDeny|SystemCall|CapabilityBoundingSet|ReadWritePaths|UMask)"
)


def first_gpu() -> str:
    pynvml.nvmlInit()
    return str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))


def tried(name: str, call: Any) -> None:
    try:
        value = call()
        fields = getattr(value, "_fields_", None)
        print(f"{name}: { ({f: getattr(value, f) for f, _ in fields} if fields else value) }")
    except Exception as exc:  # every answer is a finding, an error included
        print(f"{name} -> {type(exc).__name__}: {exc}")


def client(mode: str, mib: int, secs: int, pipe: str, uid: int | None = None) -> subprocess.Popen[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "CUDA_VISIBLE_DEVICES": first_gpu(),
        "CUDA_MPS_PIPE_DIRECTORY": pipe,
    }
    return subprocess.Popen(
        [CLIENT, mode, str(mib), str(secs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        user=uid,
        group=uid,
        extra_groups=None if uid is None else [],
    )


def said(process: subprocess.Popen[str], label: str) -> None:
    out, _ = process.communicate(timeout=120)
    print(f"[{label}] rc={process.returncode} " + " | ".join(out.strip().splitlines()))


def per_process(uuid: str, seconds: int = 6) -> None:
    """What NVML reports per process now: memory (compute and MPS lists), SM utilization by
    pid (both APIs), and the project's own sample (util_by_owner, mem_by_owner)."""
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    tried(
        "compute processes",
        lambda: [(p.pid, p.usedGpuMemory >> 20) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)],
    )
    tried(
        "MPS processes",
        lambda: [
            (p.pid, p.usedGpuMemory >> 20) for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
        ],
    )
    since = int(time.time() * 1e6) - seconds * 1_000_000
    tried(
        "process utilization",
        lambda: [(p.pid, p.smUtil, p.memUtil) for p in pynvml.nvmlDeviceGetProcessUtilization(handle, since)],
    )
    if hasattr(pynvml, "nvmlDeviceGetProcessesUtilizationInfo"):
        tried("processes utilization info", lambda: pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle))
    backend = NvmlBackend()
    try:
        sample = backend.sample(uuid)
        print(f"project sample: util {sample.util_pct}, by owner {sample.util_by_owner}")
        print(f"project sample: memory by owner {sample.mem_by_owner}")
    finally:
        backend.close()


def unit() -> None:
    """The agent unit's sandboxing against NVML, where PID 1 is systemd: ProtectClock alone
    (systemd < 252 turns it into a device allow-list that closes /dev/nvidia*), then the unit's
    own [Service] settings."""
    if Path("/proc/1/comm").read_text().strip() != "systemd":
        print("PID 1 is not systemd: the unit cannot be run here")
        return
    print(subprocess.run(["systemctl", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    shipped = [f"{k}={v}" for k, v in parser["Service"].items() if SANDBOXING.match(k)]
    nvml_init = "import pynvml; pynvml.nvmlInit(); print('nvmlInit ok', pynvml.nvmlDeviceGetCount())"
    probe = f'nvidia-smi -L; {sys.executable} -c "{nvml_init}"'
    for label, props in (
        ("ProtectClock=yes alone", ["ProtectClock=yes"]),
        ("the unit's own settings", shipped),
    ):
        argv = ["systemd-run", "--wait", "--pipe", "--quiet"] + [a for p in props for a in ("-p", p)]
        done = subprocess.run(
            [*argv, "--", "/bin/sh", "-c", probe], capture_output=True, text=True, timeout=60
        )
        print(f"== {label}: rc={done.returncode}\n{' '.join(props)}\n{done.stdout}{done.stderr}")


def nvml() -> None:
    """Fabric, remapped rows, retired pages and compute mode, as read; then two processes
    time-sliced on the GPU (no MPS), one busy and one idle: whether per-process utilization
    tells them apart."""
    uuid = first_gpu()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    for name in ("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"):
        if hasattr(pynvml, name):
            tried(name, lambda n=name: getattr(pynvml, n)(handle))
    tried("remapped rows (corr, unc, pending, failed)", lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    tried("retired pages pending", lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    tried("compute mode", lambda: pynvml.nvmlDeviceGetComputeMode(handle))
    tried("architecture", lambda: pynvml.nvmlDeviceGetArchitecture(handle))
    backend = NvmlBackend()
    try:
        tried("project inventory", backend.list_gpus)
        tried("project fabric problem ('' = ready)", lambda: backend.fabric_problem(uuid))
        tried("project memory repairs", lambda: backend.memory_repairs(uuid))
    finally:
        backend.close()
    busy, idle = client("busy", 1024, 14, "/nonexistent"), client("idle", 2048, 14, "/nonexistent")
    time.sleep(8)
    print(f"busy pid {busy.pid}, idle pid {idle.pid} (time-sliced, no MPS)")
    per_process(uuid)
    said(busy, "busy")
    said(idle, "idle")


def mps() -> None:
    """A private MPS daemon with server limits (25 %, 1 GiB), compute mode left DEFAULT:
    (a) a client that points CUDA_MPS_PIPE_DIRECTORY elsewhere runs without MPS (the hole
    EXCLUSIVE_PROCESS closes); (b) a busy and an idle MPS client: what NVML reports per
    process under MPS; (c) two clients of one uid at 900 MiB each under the 1 GiB limit
    (per-process grants: the sandbox holds 1.8 GiB)."""
    uuid = first_gpu()
    var = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))
    var.chmod(0o755)
    manager = MpsManager(var / "mps", systemd=False, enforce=False)
    uid = mps_uid(uuid)
    try:
        print("daemon started:", manager.start(uuid))
        manager.set_server_limits(uuid, 25, 1024)
        pipe = str(manager.pipe_dir(uuid))
        held = client("idle", 256, 30, pipe, uid)
        time.sleep(5)
        said(
            client("idle", 2048, 0, "/nonexistent", uid),
            "opted out while the server runs: expect every SM, 2 GiB ok",
        )
        busy, idle = client("busy", 256, 14, pipe, uid), client("idle", 512, 14, pipe, uid)
        time.sleep(8)
        print(f"MPS busy pid {busy.pid}, idle pid {idle.pid}")
        print(f"server pids {manager.server_pids(uuid)}, clients {manager.clients(uuid)}")
        per_process(uuid)
        said(busy, "MPS busy")
        said(idle, "MPS idle")
        pair = [client("idle", 900, 10, pipe, uid) for _ in range(2)]
        time.sleep(6)
        per_process(uuid)
        for n, p in enumerate(pair):
            said(p, f"one sandbox's process {n}: 900 MiB under a 1 GiB per-process limit")
        said(held, "held")
        said(client("idle", 256, 0, pipe, None), "root client through the pipe")
    finally:
        # What the daemon and its servers said: a client's 805 (no connection) names no cause.
        listing = ["ls", "-ln", str(manager.pipe_dir(uuid)), str(manager.log_dir(uuid))]
        print(subprocess.run(listing, capture_output=True, text=True, check=False).stdout)
        for log_file in sorted(manager.log_dir(uuid).glob("*.log")):
            lines = log_file.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log_file.name}:", *lines, sep="\n  ")
        print("daemon stopped:", manager.stop(uuid))
        shutil.rmtree(var, ignore_errors=True)


def fault() -> None:
    """Optional, logs one application XID (no mode change): MPS client A idles, client B
    writes to an invalid address; A's fate, a new client C during recovery (807 expected until
    A exits), and the fault as the project's backend classes it."""
    uuid = first_gpu()
    var = Path(tempfile.mkdtemp(prefix="gf-", dir="/tmp"))
    var.chmod(0o755)
    manager = MpsManager(var / "mps", systemd=False, enforce=False)
    uid = mps_uid(uuid)
    backend = NvmlBackend()
    try:
        manager.start(uuid)
        pipe = str(manager.pipe_dir(uuid))
        a = client("idle", 256, 25, pipe, uid)
        time.sleep(5)
        said(client("fault", 64, 0, pipe, uid), "B faults")
        time.sleep(2)
        started = time.monotonic()
        said(client("idle", 64, 0, pipe, uid), "C during recovery: expect 807")
        print(f"C answered after {time.monotonic() - started:.1f} s; clients now {manager.clients(uuid)}")
        # What the project's recovery (workers/gpu/mps_recovery.py) does next: terminate_client
        # for the faulted clients still attached (A), then a new client should get in.
        for server, clients in manager.clients(uuid).items():
            for pid in clients:
                tried(
                    f"terminate_client {server} {pid}",
                    lambda s=server, c=pid: manager.terminate_client(uuid, s, c),
                )
        time.sleep(3)
        said(a, "A (the neighbour), after terminate_client")
        said(client("idle", 64, 0, pipe, uid), "D after the recovery: expect ok")
        time.sleep(2)
        tried("fault events", backend.fault_events)
    finally:
        backend.close()
        print("daemon stopped:", manager.stop(uuid))
        shutil.rmtree(var, ignore_errors=True)


def tests() -> int:
    """The project's ``gpu``-marked tests, without the platform's conftest (no database or
    broker on a lent machine): they drive NVML, MPS and the process driver directly."""
    import pytest

    files = [str(f) for f in sorted((ROOT / "tests/workers").glob("test_*real.py"))]
    files.append(str(ROOT / "tests/workers/test_process_driver_gpu.py"))
    return int(
        pytest.main(
            [
                "-rA",
                "-q",
                "--noconftest",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                "-c",
                "/dev/null",
                "--rootdir",
                str(ROOT),
                *files,
            ]
        )
    )


if __name__ == "__main__":
    step = sys.argv[1]
    if step == "tests":
        sys.exit(tests())
    {"unit": unit, "nvml": nvml, "mps": mps, "fault": fault}[step]()
