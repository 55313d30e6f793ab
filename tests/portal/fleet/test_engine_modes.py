"""A GPU an engine in front of its host binds (a Slurm node's GRES) offers only the sharing
modes that engine can give, and the time-slice replicas it cuts the GPU into: the inventory
says so, the fleet keeps it, and the scheduler places nothing else there (issue 39)."""

from __future__ import annotations

from typing import Any

import pytest

from portal.fleet.inventory import BadInventory, do_sync_inventory
from portal.fleet.models import Gpu
from portal.scheduling.snapshot import build_snapshot
from scheduler.cluster import DEDICATED, MPS, TIMESLICE, GpuState

pytestmark = pytest.mark.django_db


def slurm_gpu(index: int, modes: list[str], replicas: int) -> dict[str, Any]:
    return {
        "uuid": f"SLURM-lab-n1-GPU{index}", "index": index, "name": "h100 (Slurm GRES on n1)",
        "model": "H100-80GB",
        "memory_mib": 81559, "mig_enabled": False, "mig_devices": [], "engine_modes": modes,
        "engine_replicas": replicas,
    }  # fmt: skip


def test_the_inventory_keeps_what_the_engine_offers_and_its_replicas() -> None:
    do_sync_inventory("lab-n1", "slurm", "slurm", [slurm_gpu(0, ["dedicated", "timeslice"], 2)])
    gpu = Gpu.objects.get(uuid="SLURM-lab-n1-GPU0")
    assert (gpu.engine_modes, gpu.timeslice_replicas) == (["dedicated", "timeslice"], 2)
    do_sync_inventory("lab-n1", "slurm", "slurm", [slurm_gpu(0, ["dedicated", "mps"], 0)])
    gpu.refresh_from_db()
    assert (gpu.engine_modes, gpu.timeslice_replicas) == (["dedicated", "mps"], 2)  # 0: left as it was
    [state] = [g for h in build_snapshot().hosts for g in h.gpus]
    assert state.offers == ("dedicated", "mps")


def test_an_agent_that_binds_its_own_gpus_offers_every_mode() -> None:
    gpu = slurm_gpu(0, [], 0)
    del gpu["engine_modes"], gpu["engine_replicas"]  # as every agent before the gateway sends it
    do_sync_inventory("plain", "nvml", "docker", [{**gpu, "uuid": "GPU-1"}])
    assert Gpu.objects.get(uuid="GPU-1").engine_modes == []
    [state] = [g for h in build_snapshot().hosts for g in h.gpus]
    assert state.serves(MPS) and state.serves(TIMESLICE) and state.serves(DEDICATED)


def test_an_unknown_mode_is_refused_whole() -> None:
    with pytest.raises(BadInventory, match=r"engine_modes .* not among dedicated, mps, timeslice"):
        do_sync_inventory("lab-n1", "slurm", "slurm", [slurm_gpu(0, ["mig"], 0)])


def test_the_scheduler_places_no_mode_the_engine_does_not_offer() -> None:
    shards_only = GpuState("g", "h", 0, "H100-80GB", 81559, "auto", offers=(DEDICATED, TIMESLICE))
    assert shards_only.serves(TIMESLICE) and shards_only.serves(DEDICATED) and not shards_only.serves(MPS)
    assert not shards_only.could_serve(MPS)
    pinned = GpuState("g", "h", 0, "H100-80GB", 81559, MPS, offers=(DEDICATED,))
    assert not pinned.serves(MPS)  # an admin's pin cannot give what Slurm does not
