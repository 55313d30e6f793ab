"""gpushare's agent on a Slurm node, in its monitor-only role (issue 39): it launches nothing
(Slurm does) and holds no queue; every tick it samples the node's GPUs through the same
backend a gpushare host uses (NVML; simulated on a test cluster's fake GRES), attributes each
GPU process to its Slurm job, and writes the tick to Redis for the cluster's gateway
(``workers.slurm.node_samples``), which publishes it under the node's gpushare host and GPU
names as a gpushare host's agent does: the sandbox pages, alerts, rollups and /metrics
read the same messages either way.

Which job a process is: ``scontrol listpids``, the node's slurmd's own record of each job
step's processes (whatever its proctrack plugin: cgroup, linuxproc, pgid). slurmrestd has no
such listing, and a process's environment (``SLURM_JOB_ID``) is the tenant's to write.
A GPU's Slurm index (``IDX``) is taken to be its NVML index: so it is with
``AutoDetect=nvml`` and with a gres.conf listing ``/dev/nvidia[0-N]`` in order
(docs/slurm.md).

Run it on each node as root (it reads every job's processes), with the node's own host
credential (``manage.py host_credential issue <gateway prefix><node>``):
``GPUSHARE_POOL_PREFIX=<prefix> REDIS_URL_FILE=... python -m workers.slurm.monitor``
(deploy/systemd/gpushare-slurm-monitor.service); the node is the short host name unless
``GPUSHARE_SLURM_NODE`` names it, its host ``<prefix><node>`` unless ``GPUSHARE_HOST`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import redis

from wire import config
from wire.env import env_int, env_str
from wire.telemetry import NODE_SAMPLES_TTL_S, node_samples_key
from workers.gpu import make_backend
from workers.gpu.base import GpuBackend, GpuBackendError, GpuLost
from workers.slurm.node_samples import MAX_FAULTS, JobFigures, NodeFault, NodeGpuSample, NodeSamples

log = logging.getLogger(__name__)
LISTPIDS_TIMEOUT_S = 5.0
NO_STEPS = "No job steps exist on this node"
# What a job puts on a simulated GPU (a test cluster's fake GRES): there is no process on
# the GPU to measure, so a job's load is made up, as the simulated driver makes one up.
SIMULATED_WHOLE = (0.4, 85.0)  # (fraction of the GPU's memory, utilization %)
SIMULATED_SHARE = (0.1, 25.0)


def parse_listpids(text: str) -> dict[int, int]:
    """``scontrol listpids``'s table -> {pid: job id}; lines that are not two numbers first
    (the heading, a step's "-" columns are fine) are skipped."""
    owners: dict[int, int] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].isdigit() and words[1].isdigit():
            owners[int(words[0])] = int(words[1])
    return owners


def job_pids(node: str, run: Callable[[list[str]], str] | None = None) -> dict[int, int]:
    """Every Slurm job process on ``node`` (this machine's), {pid: job id}, from its slurmd's
    step records. The node is named for a machine that runs several slurmd (a test cluster):
    without it scontrol guesses one."""
    run = run or _run
    return parse_listpids(run(["scontrol", "listpids", "*", node]))


def _run(argv: list[str]) -> str:
    done = subprocess.run(  # noqa: S603 - a fixed argv, no shell
        argv, capture_output=True, text=True, timeout=LISTPIDS_TIMEOUT_S, check=False
    )
    if done.returncode != 0 and NO_STEPS in done.stderr:
        return ""  # an idle node: listpids fails there
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


class NodeMonitor:
    """One node's ticks: sample, attribute, hand over."""

    def __init__(
        self,
        node: str,
        backend: GpuBackend,
        pids: Callable[[], dict[int, int]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.backend = backend
        self.pids = pids or (lambda: job_pids(node))
        self.clock = clock
        self.started_ms = int(clock() * 1000)
        self._faults: list[NodeFault] = []
        self._seq = 0
        self._lost: set[int] = set()
        self._loaded: set[str] = set()  # simulated GPUs: the owners given a load last tick
        self._index_of: dict[str, int] = {}  # every GPU seen, lost ones too (their events)

    def tick(self) -> NodeSamples:
        try:
            owners = self.pids()
        except (OSError, subprocess.TimeoutExpired) as exc:  # the GPUs are still worth showing
            log.warning("which job each process is: unknown this tick (%s)", exc)
            owners = {}
        listed = self.backend.list_gpus()
        gpus = {g.uuid: g.index for g in listed}
        self._index_of.update(gpus)
        if self.backend.simulated:
            self._simulate_loads(owners, gpus, {g.uuid: g.memory_mib for g in listed})
        samples: dict[int, NodeGpuSample] = {}
        for uuid, index in gpus.items():
            if index in self._lost:
                continue
            try:
                sample = self.backend.sample(uuid)
            except GpuLost:
                self._lost.add(index)
                log.error("GPU %d (%s) is lost: no longer sampled", index, uuid)
                continue
            except GpuBackendError as exc:
                log.warning("sampling GPU %d failed: %s", index, exc)
                continue
            by_job: dict[int, list[float]] = {}
            for owner, mib in sample.mem_by_owner.items():
                job = owners.get(_pid(owner), 0)
                if job:
                    by_job.setdefault(job, [0, 0.0])[0] += mib
            for owner, pct in (sample.util_by_owner or {}).items():
                job = owners.get(_pid(owner), 0)
                if job:
                    by_job.setdefault(job, [0, 0.0])[1] += pct
            samples[index] = NodeGpuSample(
                index=index,
                sample=dataclasses.replace(sample, mem_by_owner={}, util_by_owner=None),
                by_job={j: JobFigures(int(m), min(100.0, u)) for j, (m, u) in by_job.items()},
                per_job_util=sample.util_by_owner is not None,
            )
        self._note_faults()
        return NodeSamples(
            node=self.node, t_ms=int(self.clock() * 1000), started_ms=self.started_ms,
            simulated=self.backend.simulated, gpus=samples, lost=frozenset(self._lost),
            faults=tuple(self._faults),
        )  # fmt: skip

    def _note_faults(self) -> None:
        """The backend's new fault events (XIDs, a lost GPU, ECC), numbered, the newest kept;
        a GPU the backend lost is reported lost from then on."""
        try:
            events = self.backend.fault_events()
        except GpuBackendError as exc:
            log.warning("fault events not read: %s", exc)
            return
        for event in events:
            index = self._index_of.get(event.uuid)
            if index is None:
                continue  # a MIG device's: Slurm nodes' MIG devices are not gpushare's
            if event.kind == "gpu_lost":
                self._lost.add(index)
            self._seq += 1
            self._faults.append(NodeFault(self._seq, index, event.kind, event.detail, event.t_ms, event.xid))
        del self._faults[: max(0, len(self._faults) - MAX_FAULTS)]

    def _simulate_loads(self, owners: dict[int, int], gpus: dict[str, int], memory: dict[str, int]) -> None:
        """A simulated GPU has no processes: each job's first process is made to load the GPUs
        Slurm gave its job (``GPU_DEVICE_ORDINAL``, which slurmd sets for gpu, shard and mps
        GRES), keyed by its pid as NVML keys them, so what follows is NVML's path."""
        by_index = {index: uuid for uuid, index in gpus.items()}
        firsts: dict[int, int] = {}
        for pid, job in owners.items():
            firsts[job] = min(pid, firsts.get(job, pid))
        loaded = set()
        for pid in firsts.values():
            env = _environ(pid)
            if env.get("SLURMD_NODENAME", self.node) != self.node:
                continue  # a test machine runs several slurmd: another node's job
            given = env.get("GPU_DEVICE_ORDINAL", "").split(",")
            ordinals = [i for i in given if i.isascii() and i.isdigit()]
            devices = [by_index[int(i)] for i in ordinals if int(i) in by_index]
            if not devices:
                continue
            whole = bool(env.get("SLURM_JOB_GPUS"))
            share, util = SIMULATED_WHOLE if whole else SIMULATED_SHARE
            mib = int(share * memory[devices[0]])
            self.backend.note_load(f"pid:{pid}", devices, mib, util)
            loaded.add(f"pid:{pid}")
        for owner in self._loaded - loaded:
            self.backend.forget_load(owner)
        self._loaded = loaded


def _pid(owner: str) -> int:
    """The pid of an NVML owner key ``pid:<pid>``; 0 for any other."""
    number = owner.removeprefix("pid:")
    return int(number) if owner.startswith("pid:") and number.isascii() and number.isdigit() else 0


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (simulated GPUs only); {} once it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(2**20)
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def run(
    monitor: NodeMonitor, client: redis.Redis, key: str, interval_s: float, stopping: threading.Event
) -> None:
    """Tick until ``stopping``: each tick replaces the last, and expires if the monitor stops."""
    while not stopping.is_set():
        started = time.monotonic()
        try:
            client.set(key, monitor.tick().encode(), ex=max(NODE_SAMPLES_TTL_S, int(3 * interval_s) + 1))
        except redis.RedisError as exc:
            log.warning("samples not handed to the gateway: %s", exc)
        except Exception:  # a bug must not stop the node's figures for good
            log.exception("monitor tick failed")
        stopping.wait(max(0.0, interval_s - (time.monotonic() - started)))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = env_str("GPUSHARE_SLURM_NODE", socket.gethostname().split(".")[0])
    # gpushare's name for the node: as its gateway names it, <prefix><node>.
    host = env_str("GPUSHARE_HOST", env_str("GPUSHARE_POOL_PREFIX", "") + node)
    interval_s = env_int("SAMPLE_INTERVAL_MS", 1000, minimum=50) / 1000
    backend = make_backend(config.gpu_backend_kind(), host, os.environ.get("GPUSHARE_SIM_GPUS", ""))
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    client = redis.Redis.from_url(config.redis_url(), socket_timeout=2)
    log.info(
        "monitor of Slurm node %s as host %s: %d GPUs (%s)",
        node,
        host,
        len(backend.list_gpus()),
        backend.name,
    )
    try:
        run(NodeMonitor(node, backend), client, node_samples_key(host), interval_s, stopping)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
