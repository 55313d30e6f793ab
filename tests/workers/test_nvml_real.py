"""NvmlBackend on a real GPU: read-only checks of inventory and samples.

These tests never change MIG mode, clocks or power limits and never create or destroy MIG
instances: the machine they run on is shared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest

from workers.gpu import make_backend
from workers.gpu.gpm import GpmUtilization
from workers.gpu.nvml import NvmlBackend, nvml_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_available(), reason="no NVIDIA GPU visible to NVML"),
]

KNOWN_THROTTLE = {
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
    "display_clock_setting",
}


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    instance = NvmlBackend()
    yield instance
    instance.close()


def test_inventory(backend: NvmlBackend) -> None:
    gpus = backend.list_gpus()
    assert gpus
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-") and not gpu.simulated
        assert gpu.name and gpu.memory_mib > 1024
        if "H100" in gpu.name or "H200" in gpu.name or "H800" in gpu.name:
            assert gpu.model, f"{gpu.name!r} is not mapped to a model"
        layout = backend.mig_layout(gpu.uuid)
        assert sorted(layout, key=lambda d: (d.start, d.gpu_instance_id)) == layout
        assert [d for d in layout if d.usable] == list(gpu.mig_devices)
        assert [d for d in layout if not d.usable] == list(gpu.unusable_mig)
        for mig in gpu.mig_devices:
            assert mig.uuid.startswith("MIG-") and mig.parent_uuid == gpu.uuid
            assert 0 < mig.memory_mib < gpu.memory_mib
            assert 0 <= mig.start < 8 and mig.memory_slices > 0
            # The profile's memorySizeMB, and what the device itself reports, agree closely.
            total = backend.sample(mig.uuid).mem_total_mib
            assert abs(total - mig.memory_mib) <= mig.memory_mib * 0.03, (total, mig.memory_mib)


def test_samples(backend: NvmlBackend) -> None:
    now_ms = int(time.time() * 1000)
    for gpu in backend.list_gpus():
        for uuid in [gpu.uuid, *(m.uuid for m in gpu.mig_devices)]:
            sample = backend.sample(uuid)
            assert sample.uuid == uuid
            assert abs(sample.t_ms - now_ms) < 60_000
            assert 0 < sample.temp_c < 110
            assert sample.util_pct is None or 0 <= sample.util_pct <= 100
            assert 0 <= sample.mem_used_mib <= sample.mem_total_mib
            assert sample.power_w >= 0 and sample.sm_clock_mhz > 0
            assert set(sample.throttle) <= KNOWN_THROTTLE
            assert all(key.startswith("pid:") and mib >= 0 for key, mib in sample.mem_by_owner.items())
            assert sample.ecc_corrected >= 0 and sample.ecc_uncorrected >= 0
        assert backend.sample(gpu.uuid).mem_total_mib == gpu.memory_mib


def test_mig_utilization_is_gpm_or_unmeasured(backend: NvmlBackend) -> None:
    """On a MIG device (and a GPU in MIG mode) NVML has no utilization: the old code said 0.
    Now the first sample is None (no earlier GPM sample) and the next one a GPM figure where
    the GPU has GPM (Hopper), else None again."""
    migs = [(gpu, m) for gpu in backend.list_gpus() if gpu.mig_enabled for m in [None, *gpu.mig_devices]]
    if not migs:
        pytest.skip("no GPU in MIG mode here")
    for gpu, mig in migs:
        uuid = mig.uuid if mig else gpu.uuid
        assert backend.sample(uuid).util_pct is None
        time.sleep(0.2)
        second = backend.sample(uuid).util_pct
        if _has_gpm(gpu.uuid):
            assert second is not None and 0 <= second <= 100
        else:
            assert second is None


def test_gpm_reads_a_whole_gpu(backend: NvmlBackend) -> None:
    """The GPM calls themselves (ctypes structures, metric id) on a Hopper GPU: two samples
    of the whole GPU give a percentage."""
    gpus = [g for g in backend.list_gpus() if _has_gpm(g.uuid) and not g.mig_enabled]
    if not gpus:
        pytest.skip("no GPU with GPM outside MIG mode here")
    gpm = GpmUtilization()
    try:
        for gpu in gpus:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            assert gpm.read(handle, gpu.uuid, None) is None
            time.sleep(0.2)
            value = gpm.read(handle, gpu.uuid, None)
            assert value is not None and 0 <= value <= 100
    finally:
        gpm.close()


def test_mps_processes_can_be_listed(backend: NvmlBackend) -> None:
    """The MPS listing NVML offers answers (no MPS daemon is started here: the machine is
    shared; the MPS tests check a client's memory appears)."""
    for gpu in backend.list_gpus():
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        try:
            listed = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
        except pynvml.NVMLError_NotSupported:
            continue
        assert all(p.pid > 0 for p in listed)


def test_auto_takes_nvml_on_a_gpu_host() -> None:
    backend = make_backend("auto", "h", "")
    try:
        assert not backend.simulated
    finally:
        backend.close()


def test_fault_events_drain(backend: NvmlBackend) -> None:
    events = backend.fault_events()
    assert all(e.kind in {"xid", "app_xid", "ecc_dbe", "gpu_lost"} for e in events)


def _has_gpm(uuid: str) -> bool:
    try:
        return bool(
            pynvml.nvmlGpmQueryDeviceSupport(pynvml.nvmlDeviceGetHandleByUUID(uuid)).isSupportedDevice
        )
    except pynvml.NVMLError:
        return False
