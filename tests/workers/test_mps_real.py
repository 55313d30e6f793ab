"""MpsManager with the real ``nvidia-cuda-mps-control`` on a GPU host.

Starts a private daemon (its own pipe and log directories under /tmp, bound to one device
by ``CUDA_VISIBLE_DEVICES``), so it never meets a daemon someone else runs on the default
``/tmp/nvidia-mps``; sets the defaults, reads them back, lists servers, and quits it. No
client connects, so no MPS server is spawned and the GPU is left as it was.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.gpu.mps import CONTROL_BINARY, MpsManager
from workers.gpu.nvml import NvmlBackend, nvml_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_available(), reason="no NVIDIA GPU visible to NVML"),
    pytest.mark.skipif(shutil.which(CONTROL_BINARY) is None, reason=f"{CONTROL_BINARY} is not installed"),
]


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
def manager(device_uuid: str) -> Iterator[MpsManager]:
    var_dir = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))  # short: socket paths are limited
    manager = MpsManager(var_dir / "mps")
    yield manager
    manager.stop(device_uuid)
    shutil.rmtree(var_dir, ignore_errors=True)


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
