"""The Alibaba openb trace as the FGD paper (ATC'23) replays it.

Loads the node and pod CSVs and builds one seed's workload exactly as the paper's simulator
does (see shared/anchors/FGD_PROTOCOL.md, section 2): every row becomes a pod, pods are
sorted by name and shuffled, the GPU total is tuned to ``tune`` x the cluster's GPU capacity
by appending clones (or removing pods), and the nodes get a random priority that breaks
score ties. The RNG is Python's, not Go's, so runs match the paper statistically, not
pod for pod.
"""

from __future__ import annotations

import csv
import random
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scheduler.placement.workload import MILLI, TYPICAL_THRESHOLD, TypicalPod, typical_of


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class PodSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU; 0 for CPU-only pods
    models: tuple[str, ...]  # accepted GPU models; empty accepts any
    source: str  # the trace pod this one copies (its own name unless it is a clone)

    @property
    def total_gpu_milli(self) -> int:
        return self.gpu_milli * self.num_gpu

    @property
    def sharing(self) -> bool:
        """Takes part of one GPU: the only kind whose GPU choice is a policy decision."""
        return self.num_gpu == 1 and self.gpu_milli < MILLI

    @property
    def shape(self) -> tuple[int, int, int, tuple[str, ...]]:
        """What a ``WorkloadModel`` counts: CPU, milli per GPU, GPU count, accepted models."""
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, self.models)

    @property
    def resource_key(self) -> tuple[int, int, int, str]:
        """What the paper's ``GetPodResource`` sees: CPU, milli per GPU, GPU count, model string."""
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, "|".join(self.models))


@dataclass(frozen=True, slots=True)
class Workload:
    nodes: list[NodeSpec]  # sorted by name
    pods: list[PodSpec]  # in arrival order: shuffled originals, then clones
    priority: list[int]  # per node: its random name prefix; the smallest wins a score tie
    typical: list[TypicalPod]  # FGD's target workload, from the original pods
    capacity_milli: int  # the cluster's GPU milli
    rng_state: tuple[Any, ...]  # the seed's RNG after building: the replay draws on from here

    @property
    def total_gpus(self) -> int:
        return self.capacity_milli // MILLI


def load_nodes(path: Path) -> list[NodeSpec]:
    """GPU nodes only: the paper never loads CPU-only nodes (empty model, no GPUs)."""
    nodes = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            gpus = int(row["gpu"] or 0)
            if gpus == 0 or not row["model"]:
                continue
            nodes.append(
                NodeSpec(row["sn"], int(row["cpu_milli"]), int(row["memory_mib"]), gpus, row["model"])
            )
    return nodes


def load_pods(path: Path) -> list[PodSpec]:
    """Every row, whatever its phase; GPU fields count only when num_gpu is non-zero."""
    pods = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            num_gpu = int(row["num_gpu"] or 0)
            milli, models = 0, tuple[str, ...]()
            if num_gpu:
                milli = min(max(int(row["gpu_milli"] or 0), 0), MILLI)
                # The multigpu traces have no gpu_spec column at all.
                models = tuple(part for part in (row.get("gpu_spec") or "").split("|") if part)
            name = row["name"]
            pods.append(
                PodSpec(name, int(row["cpu_milli"]), int(row["memory_mib"]), num_gpu, milli, models, name)
            )
    return pods


def typical_pods(pods: list[PodSpec], threshold: float = TYPICAL_THRESHOLD) -> list[TypicalPod]:
    """FGD's target workload: the commonest pod shapes of the *whole* trace (memory is not
    part of a shape). The paper's baselines get this look-ahead; gpushare learns online."""
    return typical_of(Counter(p.shape for p in pods), threshold)


def build_workload(nodes: list[NodeSpec], pods: list[PodSpec], seed: int, tune: float) -> Workload:
    """One seed's replay: the consumption order of the RNG follows the paper's."""
    nodes = sorted(nodes, key=lambda n: n.name)
    originals = sorted(pods, key=lambda p: p.name)
    typical = typical_pods(originals)
    rng = random.Random(seed)
    rng.random()  # the paper draws one number for a debug log line before shuffling
    shuffled = originals[:]
    rng.shuffle(shuffled)
    capacity = sum(n.gpus for n in nodes) * MILLI
    workload = tune_pods(shuffled, originals, tune * capacity, rng)
    priority = list(range(len(nodes)))
    rng.shuffle(priority)
    return Workload(nodes, workload, priority, typical, capacity, rng.getstate())


def tune_pods(
    shuffled: list[PodSpec], originals: list[PodSpec], target: float, rng: random.Random
) -> list[PodSpec]:
    """Inflate (or deflate) the workload's GPU request to ``target`` milli.

    Inflation draws name-sorted originals with replacement and appends clones until a draw
    would overshoot. The paper's overshoot test uses the drawn pod's milli *per GPU*
    while the running total adds its full request, so a multi-GPU clone can land past the
    target; that quirk is kept. Deflation drops random pods until the total fits.
    """
    pods = shuffled[:]
    total = sum(p.total_gpu_milli for p in pods)
    # Without a GPU pod to draw, the paper's loop would never end (CPU-only draws add 0).
    if total < target and any(p.gpu_milli for p in originals):
        clones = 0
        while True:
            drawn = originals[rng.randrange(len(originals))]
            if total + drawn.gpu_milli > target:
                break
            pods.append(replace(drawn, name=f"{drawn.name}-tuned-{clones}"))
            clones += 1
            total += drawn.total_gpu_milli
    elif total > target:
        while total > target:
            total -= pods.pop(rng.randrange(len(pods))).total_gpu_milli
    return pods


def load_pod_times(path: Path) -> dict[str, tuple[int, int]]:
    """Each pod's creation and deletion time (trace seconds), by name: what a replay with
    departures needs and the paper's protocol ignores."""
    with path.open(newline="") as f:
        return {
            row["name"]: (int(row["creation_time"] or 0), int(row["deletion_time"] or 0))
            for row in csv.DictReader(f)
        }
