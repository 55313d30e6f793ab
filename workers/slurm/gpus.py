"""A Slurm node's GPUs as a gpushare GPU backend: what its ``gpu`` GRES declares, each GPU
named by its node and index (Slurm's ``IDX``), since Slurm, not gpushare, binds devices to
jobs and the gateway sees no GPU of its own.

A GPU that a job submitted outside gpushare holds (any part of it: the whole GPU, shards
of it, an MPS share) is reported not ready, with the job that holds it, so gpushare places
nothing there and its fleet page says why; so is every GPU of a node Slurm drains. Both come
back by themselves once Slurm frees them. The GPUs' samples are the node's monitor's
(``workers.slurm.monitor``: NVML on the node), read through the gateway's ``MonitorFeed``,
each job's figures under its sandbox's allocation key; a node without a running monitor has
none (``GpuNotSampled``), and its GPUs show no figures.
"""

from __future__ import annotations

from scheduler.gpus import CATALOG
from workers.gpu.base import (
    COMPUTE_DEFAULT,
    FaultEvent,
    GpuBackendError,
    GpuInfo,
    GpuLost,
    GpuNotSampled,
    GpuSample,
    MemoryRepairs,
    MigDevice,
)
from workers.slurm.feed import MonitorFeed
from workers.slurm.model import SlurmJob
from workers.slurm.view import ClusterView

UUID_PREFIX = "SLURM-"


def gpu_uuid(host: str, index: int) -> str:
    return f"{UUID_PREFIX}{host}-GPU{index}"


def gpu_index(uuid: str) -> int:
    """The Slurm index of a GPU named by ``gpu_uuid``; ValueError for any other name."""
    if not uuid.startswith(UUID_PREFIX) or "-GPU" not in uuid:
        raise ValueError(f"{uuid!r} is not a Slurm node's GPU")
    return int(uuid.rsplit("-GPU", 1)[1])


def host_of(uuid: str) -> str:
    """The gpushare host of a GPU named by ``gpu_uuid``; ValueError for any other name."""
    gpu_index(uuid)
    return uuid.removeprefix(UUID_PREFIX).rsplit("-GPU", 1)[0]


def catalog_model(gres_type: str, models: dict[str, str]) -> str:
    """gpushare's name for a GPU of this Slurm GRES type: the operator's mapping
    (GPUSHARE_SLURM_GPU_MODELS, ``h100=H100-80GB``), else the only catalog model whose name
    starts with the type (``h200`` -> H200), else "" (an unknown model)."""
    if gres_type in models:
        return models[gres_type]
    found = [name for name in CATALOG if name.lower().startswith(gres_type.lower())] if gres_type else []
    return found[0] if len(found) == 1 else ""


def holder_of(jobs: list[SlurmJob], node: str, index: int) -> SlurmJob | None:
    """The job outside gpushare that holds part of GPU ``index`` of ``node``, if any."""
    return next((j for j in jobs if j.allocation_key is None and index in j.gpu_indices(node)), None)


class SlurmGpus:
    """The GPU backend of one Slurm node, read from the gateway's ``ClusterView``."""

    devices_bound_elsewhere = True  # Slurm binds each job's GRES and runs MPS on the node

    def __init__(
        self,
        host: str,
        node: str,
        view: ClusterView,
        simulated: bool,
        models: dict[str, str],
        feed: MonitorFeed | None = None,
    ) -> None:
        self.host = host  # gpushare's name for the node
        self.node = node  # Slurm's
        self.view = view
        self.simulated = simulated
        # The fleet badges a test cluster's fake GRES as simulated (portal.fleet.models).
        self.name = "slurm-sim" if simulated else "slurm"
        self.models = models
        self.feed = feed

    def list_gpus(self) -> list[GpuInfo]:
        node = self.view.node(self.node)
        if node is None:
            return []
        jobs = self.view.active_jobs_on(self.node)
        model = catalog_model(node.gpu_model, self.models)
        memory = CATALOG[model].memory_mib if model in CATALOG else 0
        # Slurm hands out a whole GPU always, a time-slice replica as shards, an MPS share as
        # mps units: a mode whose GRES the node lacks is not offered.
        modes = ("dedicated", *(("timeslice",) if node.shards else ()), *(("mps",) if node.mps else ()))
        replicas = node.shards // node.gpus if node.gpus else 0
        gpus = []
        for index in range(node.gpus):
            holder = holder_of(jobs, self.node, index)
            if node.draining:
                why = f"node {self.node} is drained in Slurm" + (
                    f": {node.reason[:100]}" if node.reason else ""
                )
            elif holder is not None:
                why = f"held by Slurm job {holder.job_id} ({holder.user}), submitted outside gpushare"
            else:
                why = ""
            gpus.append(
                GpuInfo(
                    uuid=gpu_uuid(self.host, index), index=index,
                    name=f"{node.gpu_model or 'gpu'} (Slurm GRES on {self.node})", model=model,
                    memory_mib=memory, mig_enabled=False, simulated=self.simulated, not_ready=why,
                    engine_modes=modes, engine_replicas=replicas,
                )
            )  # fmt: skip
        return gpus

    def host_facts(self) -> tuple[int, int]:
        node = self.view.node(self.node)
        return (node.cpus, node.memory_mib) if node is not None else (0, 0)

    def sample(self, uuid: str) -> GpuSample:
        index = gpu_index(uuid)
        if host_of(uuid) != self.host:  # a multi-node sandbox's GPU on another node
            raise GpuNotSampled(f"{uuid}: sampled by its own node, not by {self.host}")
        tick = self.feed.latest(self.host) if self.feed is not None else None
        if tick is None:
            raise GpuNotSampled(f"{uuid}: no samples from the monitor on Slurm node {self.node}")
        if index in tick.lost:
            raise GpuLost(f"{uuid}: the monitor on Slurm node {self.node} lost it", uuid)
        gpu = tick.gpus.get(index)
        if gpu is None:
            raise GpuNotSampled(f"{uuid}: the monitor on Slurm node {self.node} has no sample of it")
        return gpu.as_gpu_sample(uuid, self.view.allocation_keys())

    def mig_layout(self, uuid: str) -> list[MigDevice]:
        return []

    def create_mig(self, uuid: str, profile: str, start: int) -> MigDevice:
        raise GpuBackendError("MIG layouts on a Slurm node are Slurm's (gres.conf), not gpushare's")

    def destroy_mig(self, uuid: str, mig_uuid: str) -> None:
        raise GpuBackendError("MIG layouts on a Slurm node are Slurm's (gres.conf), not gpushare's")

    def fault_events(self) -> list[FaultEvent]:
        if self.feed is None:
            return []
        return [f.as_event(gpu_uuid(self.host, f.index)) for f in self.feed.new_faults(self.host)]

    def fabric_problem(self, uuid: str) -> str:
        return next((g.not_ready for g in self.list_gpus() if g.uuid == uuid), "")

    def memory_repairs(self, uuid: str) -> MemoryRepairs:
        return MemoryRepairs()

    def note_load(self, owner: str, device_uuids: list[str], mem_mib: int, util_pct: float) -> None:
        return None

    def forget_load(self, owner: str) -> None:
        return None

    def compute_mode(self, uuid: str) -> str:
        return COMPUTE_DEFAULT

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        raise GpuBackendError("a Slurm node's compute modes are its administrator's (Slurm's MPS prolog)")

    def close(self) -> None:
        return None
