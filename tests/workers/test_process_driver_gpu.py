"""The process driver on a real GPU: a CUDA program runs in the sandbox and sees one GPU.

Compiles a tiny vector add with ``nvcc`` (as gpu-checks/procdriver_check.py does) into a
directory the sandbox reaches the way a host's driver libraries do, through the agent's
``LD_LIBRARY_PATH`` (bound read-only into GPU sandboxes), so the host's /usr is left alone.
The program runs with ``CUDA_VISIBLE_DEVICES`` unset: what isolates the sandbox is the set
of device nodes it was given, not a variable the tenant controls. Skipped without nvcc,
bubblewrap or an NVIDIA GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from wire.spec import SandboxSpec
from workers.drivers.process import ProcessDriver, bwrap_available

VADD = r"""
#include <cstdio>
#include <cuda_runtime.h>
__global__ void add(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) c[i] = a[i] + b[i];
}
int main() {
  int n = 1 << 20, count = 0; cudaError_t e = cudaGetDeviceCount(&count);
  printf("devices=%d (%s)\n", count, cudaGetErrorString(e)); if (e != cudaSuccess || !count) return 2;
  static float ha[1 << 20], hb[1 << 20], hc[1 << 20];
  for (int i = 0; i < n; i++) { ha[i] = 1; hb[i] = 2; }
  float *a, *b, *c; cudaMalloc(&a, n * 4); cudaMalloc(&b, n * 4); cudaMalloc(&c, n * 4);
  cudaMemcpy(a, ha, n * 4, cudaMemcpyHostToDevice); cudaMemcpy(b, hb, n * 4, cudaMemcpyHostToDevice);
  add<<<(n + 255) / 256, 256>>>(a, b, c, n); e = cudaDeviceSynchronize();
  cudaMemcpy(hc, c, n * 4, cudaMemcpyDeviceToHost);
  printf("kernel=%s c=%f\n", cudaGetErrorString(e), hc[123]);
  return (e == cudaSuccess && hc[123] == 3.0f) ? 0 : 3;
}
"""


def _devices() -> list[tuple[str, bool]]:
    """(UUID, is a MIG device) of every device NVML sees; [] without a GPU or driver."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    found: list[tuple[str, bool]] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig = False
            if not mig:
                found.append((pynvml.nvmlDeviceGetUUID(handle), False))
                continue
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    child = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError:
                    continue
                found.append((pynvml.nvmlDeviceGetUUID(child), True))
    finally:
        pynvml.nvmlShutdown()
    return found


DEVICES = _devices()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not DEVICES, reason="no NVIDIA GPU visible to NVML"),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed"),
    pytest.mark.skipif(not DEVICES or not bwrap_available(), reason="bubblewrap cannot run here"),
]


@pytest.fixture(scope="module")
def vadd_dir() -> Iterator[Path]:
    """A world-readable directory holding the compiled program (the sandbox's uid reads it)."""
    directory = Path(tempfile.mkdtemp(prefix="gpushare-vadd-"))
    directory.chmod(0o755)
    (directory / "vadd.cu").write_text(VADD)
    nvcc = shutil.which("nvcc") or "nvcc"
    subprocess.run(
        [nvcc, "-O2", "-o", str(directory / "vadd"), str(directory / "vadd.cu")], check=True, timeout=300
    )
    yield directory
    shutil.rmtree(directory)


def run_in_sandbox(tmp_path: Path, device: str, script: str) -> tuple[int | None, str]:
    driver = ProcessDriver(tmp_path / "state", host="gpu-test")
    spec = SandboxSpec(
        allocation_key=f"gpu{uuid.uuid4().hex[:12]}", sandbox_id=900_001, host="gpu-test", project="p",
        owner="o", image="", command=("sh", "-c", script), device_uuids=(device,), real_gpu=True,
        memory_limit_mib=4096, pids_limit=4096, shm_size_mib=256,
    )  # fmt: skip
    handle = driver.launch(spec)
    try:
        deadline = time.monotonic() + 180
        while driver.status(handle).state == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        out = driver.read_output(handle, 0, 1 << 20).data.decode(errors="replace")
        return driver.status(handle).exit_code, out
    finally:
        driver.stop(handle, grace_s=1)


def _script(vadd: Path) -> str:
    return f"ls /dev | grep nvidia; unset CUDA_VISIBLE_DEVICES; {vadd / 'vadd'}"


@pytest.mark.parametrize("mig", [False, True], ids=["whole-gpu", "mig-instance"])
def test_a_cuda_program_runs_on_exactly_its_own_gpu(
    tmp_path: Path, vadd_dir: Path, monkeypatch: pytest.MonkeyPatch, mig: bool
) -> None:
    device = next((u for u, is_mig in DEVICES if is_mig == mig), None)
    if device is None:
        pytest.skip("no MIG device on this host" if mig else "every GPU is in MIG mode")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{vadd_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"))
    code, out = run_in_sandbox(tmp_path, device, _script(vadd_dir))
    assert code == 0, out
    assert "devices=1 (no error)" in out, out  # one GPU, even with CUDA_VISIBLE_DEVICES unset
    assert "kernel=no error c=3.000000" in out, out
    nodes = [line for line in out.splitlines() if line.startswith("nvidia") and line[6:].isdigit()]
    assert len(nodes) == 1, out  # one /dev/nvidiaN: its own GPU (or its MIG instance's parent)
