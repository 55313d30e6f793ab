"""NvmlBackend on a real GPU: read-only checks of inventory and samples.

These tests never change MIG mode, clocks or power limits and never create or destroy MIG
instances: the machine they run on is shared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

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
        assert backend.mig_layout(gpu.uuid) == list(gpu.mig_devices)
        for mig in gpu.mig_devices:
            assert mig.uuid.startswith("MIG-") and mig.parent_uuid == gpu.uuid
            assert 0 < mig.memory_mib < gpu.memory_mib
            assert 0 <= mig.start < 8 and mig.memory_slices > 0


def test_samples(backend: NvmlBackend) -> None:
    now_ms = int(time.time() * 1000)
    for gpu in backend.list_gpus():
        for uuid in [gpu.uuid, *(m.uuid for m in gpu.mig_devices)]:
            sample = backend.sample(uuid)
            assert sample.uuid == uuid
            assert abs(sample.t_ms - now_ms) < 60_000
            assert 0 < sample.temp_c < 110
            assert 0 <= sample.util_pct <= 100
            assert 0 <= sample.mem_used_mib <= sample.mem_total_mib
            assert sample.power_w >= 0 and sample.sm_clock_mhz > 0
            assert set(sample.throttle) <= KNOWN_THROTTLE
            assert all(key.startswith("pid:") and mib >= 0 for key, mib in sample.mem_by_owner.items())
            assert sample.ecc_corrected >= 0 and sample.ecc_uncorrected >= 0
        assert backend.sample(gpu.uuid).mem_total_mib == gpu.memory_mib


def test_health_events_drain(backend: NvmlBackend) -> None:
    events = backend.health_events()
    assert all(e.kind in {"xid", "ecc_dbe", "gpu_lost"} for e in events)
