"""The gateway's picture of its cluster: every node and every job slurmctld knows, read
together from slurmrestd every ``GPUSHARE_SLURM_POLL_MS`` and shared by every node's agent,
so that a cluster of any size costs two requests a poll, not two per node. The jobs are
indexed by node and by id as they are read: every node's agent asks for its own each poll,
and its sampler each tick, which scanning every job would make grow with nodes times jobs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from workers.slurm.model import SlurmJob, SlurmNode
from workers.slurm.rest import SlurmRest


@dataclass
class ClusterView:
    rest: SlurmRest
    nodes: dict[str, SlurmNode] = field(default_factory=dict)
    jobs: tuple[SlurmJob, ...] = ()
    read_at: float = 0.0  # monotonic time of the last complete read; 0 before the first

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._on_node: dict[str, list[SlurmJob]] = {}
        self._by_id: dict[int, SlurmJob] = {}
        self._keys: dict[int, str] = {}  # gpushare's jobs: job id -> allocation key

    def refresh(self) -> None:
        """Read nodes and jobs again; SlurmError (the old picture kept) when slurmrestd fails."""
        nodes = {n.name: n for n in self.rest.nodes()}
        jobs = tuple(self.rest.jobs())
        on_node: dict[str, list[SlurmJob]] = {}
        for job in jobs:
            for name in job.nodes:
                on_node.setdefault(name, []).append(job)
        by_id = {j.job_id: j for j in jobs}
        keys = {j.job_id: j.allocation_key for j in jobs if j.allocation_key is not None}
        with self._lock:
            self.nodes, self.jobs, self.read_at = nodes, jobs, time.monotonic()
            self._on_node, self._by_id, self._keys = on_node, by_id, keys

    def node(self, name: str) -> SlurmNode | None:
        with self._lock:
            return self.nodes.get(name)

    def active_jobs_on(self, node: str) -> list[SlurmJob]:
        return [j for j in self.jobs_on(node) if j.active]

    def jobs_on(self, node: str) -> list[SlurmJob]:
        """Every job on the node slurmctld still knows, ended ones too (for MinJobAge)."""
        with self._lock:
            return list(self._on_node.get(node, ()))

    def job(self, job_id: int) -> SlurmJob | None:
        with self._lock:
            return self._by_id.get(job_id)

    def allocation_keys(self) -> dict[int, str]:
        """The allocation key of each gpushare job, by job id (ended ones too)."""
        with self._lock:
            return self._keys

    def job_for(self, allocation_key: str) -> SlurmJob | None:
        """gpushare's active job for this allocation, as of the last read."""
        with self._lock:
            return next((j for j in self.jobs if j.active and j.allocation_key == allocation_key), None)

    def age_s(self) -> float:
        return time.monotonic() - self.read_at if self.read_at else float("inf")
