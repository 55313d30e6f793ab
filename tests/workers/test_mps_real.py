"""MpsManager with the real ``nvidia-cuda-mps-control`` on a GPU host.

Starts a private daemon (its own pipe and log directories under /tmp, bound to one device
by ``CUDA_VISIBLE_DEVICES``), so it never meets a daemon someone else runs on the default
``/tmp/nvidia-mps``, and quits it at the end. Changes no driver setting: on a lent GPU the
rule is never to change compute mode, MIG mode or clocks, so the manager is built here with
``enforce=False`` (compute mode neither set nor read), never through the agent's
``HostContext``, which always enforces EXCLUSIVE_PROCESS. The shares here are therefore the
unenforced kind (a client that leaves MPS gets the whole device: the baseline below does
exactly that); tests/workers/test_mps_enforced.py covers enforcement on the fake NVML.

The first test only configures the daemon; the second connects a client the way a
sandbox does (review §3.5, gpu-checks/mps_checks.sh): a CUDA program running as the GPU's
MPS uid, not root, through the pipe directory the agent makes, with none of the
``CUDA_MPS_*`` limits in its environment, so that only the server's limits can bind it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from wire import uids
from workers.gpu import posix_acl
from workers.gpu.mps import CONTROL_BINARY, MpsManager
from workers.gpu.nvml import NvmlBackend, nvml_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_available(), reason="no NVIDIA GPU visible to NVML"),
    pytest.mark.skipif(shutil.which(CONTROL_BINARY) is None, reason=f"{CONTROL_BINARY} is not installed"),
]

THREAD_PCT, LIMIT_MIB, OVER_MIB = 25, 1024, 2048  # the client asks for twice its server's limit
HOLD_S = 20  # how long the client keeps a context open, for the server and NVML to be read

# Prints the SMs it is given, tries OVER_MIB past the limit, then holds a small allocation.
CLIENT_CU = r"""
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <cuda_runtime.h>
int main(int argc, char** argv) {
  size_t over = strtoull(argv[1], 0, 10) << 20; int hold = atoi(argv[2]);
  cudaDeviceProp p; cudaError_t e = cudaGetDeviceProperties(&p, 0);
  if (e != cudaSuccess) { printf("init failed: %s\n", cudaGetErrorString(e)); return 2; }
  printf("SMs=%d\n", p.multiProcessorCount);
  void* big = 0; e = cudaMalloc(&big, over);
  printf("big alloc: %s\n", e == cudaSuccess ? "ok" : cudaGetErrorString(e));
  if (big) cudaFree(big);
  cudaGetLastError();
  void* small = 0; e = cudaMalloc(&small, 64 << 20);
  printf("small alloc: %s\n", e == cudaSuccess ? "ok" : cudaGetErrorString(e)); fflush(stdout);
  sleep(hold); return 0;
}
"""
CLIENT_PY = """
import sys, time, torch
print("SMs=%d" % torch.cuda.get_device_properties(0).multi_processor_count)
try:
    big = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda"); print("big alloc: ok")
    del big
except Exception as exc:
    print("big alloc: %s" % str(exc).splitlines()[0])
small = torch.empty(64 << 20, dtype=torch.uint8, device="cuda"); print("small alloc: ok", flush=True)
time.sleep(int(sys.argv[2]))
"""


@pytest.fixture
def device_uuid() -> str:
    """A whole GPU, or on a MIG-enabled one its first MIG device (MPS runs per MIG device)."""
    backend = NvmlBackend()
    try:
        for gpu in backend.list_gpus():
            if not gpu.mig_enabled:
                return gpu.uuid
            if gpu.mig_devices:
                return gpu.mig_devices[0].uuid
    finally:
        backend.close()
    pytest.skip("every GPU is in MIG mode with no MIG device")


@pytest.fixture
def var_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))  # short: socket paths are limited
    path.chmod(0o755)  # the client's uid reaches its program and the pipe directory below
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager(device_uuid: str, var_dir: Path) -> Iterator[MpsManager]:
    # Started directly (no systemd unit left behind by a test); enforce=False: the lent GPU's
    # compute mode is never changed (nor read) by these tests.
    manager = MpsManager(var_dir / "mps", systemd=False, enforce=False)
    yield manager
    manager.stop(device_uuid)


def test_start_configure_and_quit_a_real_daemon(manager: MpsManager, device_uuid: str) -> None:
    assert manager.start(device_uuid) is True
    assert manager.running(device_uuid)
    assert manager.start(device_uuid) is False
    manager.set_default_active_thread_percentage(device_uuid, 25)
    manager.set_default_pinned_mem_limit(device_uuid, 2048)
    assert float(manager.command(device_uuid, "get_default_active_thread_percentage")) == 25.0
    limit = manager.command(device_uuid, "get_default_device_pinned_mem_limit 0")
    assert limit in {"2048M", "2G"}, limit  # drivers differ in how they print it
    assert manager.server_pids(device_uuid) == []  # no client yet, so no server
    assert manager.stop(device_uuid) is True
    assert not manager.running(device_uuid)


def _client(var_dir: Path) -> list[str]:
    """The client's command: a CUDA program built with nvcc, else a torch script."""
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc:
        source, binary = var_dir / "client.cu", var_dir / "client"
        source.write_text(CLIENT_CU)
        built = subprocess.run(
            [nvcc, "-o", str(binary), str(source)], capture_output=True, text=True, timeout=300, check=False
        )
        if built.returncode == 0:
            binary.chmod(0o755)
            return [str(binary)]
    if importlib.util.find_spec("torch") is not None:
        script = var_dir / "client.py"
        script.write_text(CLIENT_PY)
        script.chmod(0o644)
        return [os.path.realpath(sys.executable), str(script)]
    pytest.skip("neither nvcc nor torch here to build a CUDA client")


def _run_client(
    argv: list[str], device: str, pipe: Path, uid: int | None, hold_s: int = 0
) -> subprocess.Popen[str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(pipe.parent.parent.parent),  # var_dir: anything traversable
        "CUDA_VISIBLE_DEVICES": device,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        # No CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: a tenant
        # who unset them. Only the server's limits are left to bind.
    }
    return subprocess.Popen(
        [*argv, str(OVER_MIB), str(hold_s)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        user=uid,
        group=uid,
        extra_groups=None if uid is None else [],
    )


def _said(process: subprocess.Popen[str], timeout: float = 120) -> str:
    out, _ = process.communicate(timeout=timeout)
    return out


def _sms(text: str) -> int:
    found = re.search(r"SMs=(\d+)", text)
    assert found, text
    return int(found.group(1))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching the client to the GPU's MPS uid needs root")
def test_a_non_root_client_is_held_to_the_servers_limits_without_its_environment(
    manager: MpsManager, device_uuid: str, var_dir: Path
) -> None:
    argv = _client(var_dir)
    # The same program without MPS (a pipe directory with no daemon): the whole device, and
    # the big allocation fits, so what fails later fails because of the server's limit.
    alone = var_dir / "no-daemon"
    alone.mkdir(mode=0o755)
    without = _said(_run_client(argv, device_uuid, alone, uid=None))
    if "big alloc: ok" not in without:
        pytest.skip(f"the device cannot hold {OVER_MIB} MiB even without MPS: {without}")
    full_sms = _sms(without)

    manager.start(device_uuid)
    manager.set_server_limits(device_uuid, THREAD_PCT, LIMIT_MIB)  # what MpsDaemons.claim does
    pipe = manager.pipe_dir(device_uuid)
    uid = uids.mps_uid(device_uuid)
    info = pipe.stat()  # the agent's layout: root's, the MPS uid's group, sticky, the uid's ACL
    assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (0, uid, 0o1770)
    assert posix_acl.named_users(pipe) == {uid: 0o7}
    client = _run_client(argv, device_uuid, pipe, uid=uid, hold_s=HOLD_S)
    try:
        servers: list[int] = []
        deadline = time.monotonic() + HOLD_S - 5
        while time.monotonic() < deadline and not servers:
            servers = [s for s, clients in manager.clients(device_uuid).items() if client.pid in clients]
            time.sleep(0.5)
        # The client reached the daemon: its server lists it (a client that cannot reach
        # the pipe directory runs without MPS, silently, and no server would list it).
        assert servers, manager.clients(device_uuid)
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
            mps_list = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            listed: dict[int, int] | None = {p.pid: p.usedGpuMemory for p in mps_list}
        except pynvml.NVMLError_NotSupported:
            listed = None  # not for this device (a MIG device, on some drivers): not checked
        finally:
            pynvml.nvmlShutdown()
        # NVML accounts the MPS client's memory to it (review §1.4: the agent's per-sandbox
        # memory needs this list, not the plain compute list).
        assert listed is None or listed.get(client.pid), listed
        said = _said(client)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert "small alloc: ok" in said, said
    assert "big alloc: ok" not in said, (
        f"{OVER_MIB} MiB allocated past a {LIMIT_MIB} MiB server limit: {said}"
    )
    assert _sms(said) < full_sms, (said, full_sms)  # measured on an H200: 32 of 132 at 25 %
