"""Replay an openb trace through the product's own scheduler.

The fleet is a ``Snapshot`` that mirrors the trace's GPU nodes: one up host per node with
its CPU and memory, its GPUs following demand (``AUTO``), so any GPU can take a whole-GPU
pod, MPS shares or nothing. Each pod becomes the ``Request`` the portal would make of it:

- a pod of whole GPUs: a dedicated request for that many GPUs;
- a pod of part of one GPU: an MPS share with thread % = milli / 10 (the trace has no GPU
  memory figure, so no pinned-memory limit);
- a pod without GPUs: a CPU-only request;

with its CPU, memory and accepted GPU models. Two engines:

- ``replay_live``: arrivals in batches of ``batch`` per cycle through ``run_cycle``, the
  function the control worker calls, with the product's default policy, its queue order,
  fair share and all. A pod the cycle leaves pending has failed (nothing ever leaves, so
  a pod that cannot start now never will), as the paper counts a pod no node takes.
- ``replay_offline``: the same policy asked for one pod at a time, without the cycle.

Either way the policy learns the typical pods from the pods already arrived (the live
engine: the batch being scheduled included), never from the trace ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from scheduler.cluster import (
    AUTO,
    CPU_ONLY,
    DEDICATED,
    MPS,
    GpuState,
    HostState,
    Place,
    Request,
    Snapshot,
    book,
)
from scheduler.cycle import run_cycle
from scheduler.gpus import CATALOG
from scheduler.placement import DEFAULT_POLICY, Policy, get_policy
from scheduler.placement.fragmentation import Fragmentation
from scheduler.placement.gpushare import GpusharePolicy
from scheduler.research.result import ReplayResult
from scheduler.research.trace import NodeSpec, PodSpec, Workload

TIMESLICE_REPLICAS = 4
DEFAULT_BATCH = 100


def mirror_snapshot(nodes: list[NodeSpec]) -> Snapshot:
    """Up hosts in the nodes' order, each GPU following demand."""
    hosts = []
    for node in nodes:
        memory = CATALOG[node.model].memory_mib if node.model in CATALOG else 0
        gpus = [
            GpuState(
                f"{node.name}-gpu{i}", node.name, i, node.model, memory, AUTO, replicas=TIMESLICE_REPLICAS
            )
            for i in range(node.gpus)
        ]
        hosts.append(HostState(node.name, True, gpus, cpu_milli=node.cpu_milli, memory_mib=node.memory_mib))
    return Snapshot(hosts=hosts)


def pod_request(seq: int, pod: PodSpec) -> Request:
    """The request the portal would make of a pod (see the module's docstring)."""
    mode, gpu_count, threads = DEDICATED, pod.num_gpu, 0
    if pod.num_gpu == 0 or pod.gpu_milli == 0:
        mode, gpu_count = CPU_ONLY, 1
    elif pod.sharing:
        mode, gpu_count, threads = MPS, 1, max(1, pod.gpu_milli // 10)
    return Request(
        id=seq,
        project="trace",
        priority=0,
        submitted_at=float(seq),
        mode=mode,
        gpu_count=gpu_count,
        mps_thread_pct=threads,
        cpu_milli=pod.cpu_milli,
        memory_mib=pod.memory_mib,
        gpu_models=pod.models,
    )


def learn(policy: Policy, seq: int, pod: PodSpec) -> None:
    """Show an arrived pod to the policy's workload model, if it keeps one."""
    if isinstance(policy, GpusharePolicy):
        policy.workload.observe(seq, pod.shape)


class _Recorder:
    """Fills a ``ReplayResult`` pod by pod: where it went, what arrived, what is allocated."""

    def __init__(self, workload: Workload, snapshot: Snapshot) -> None:
        self.result = ReplayResult(workload)
        self.snapshot = snapshot
        self.hosts = {h.name: (n, h) for n, h in enumerate(snapshot.hosts)}
        self.frag = Fragmentation(workload.typical)  # the paper's F, for its Fig. 7a curve
        self.frags = [self._frag(h) for h in snapshot.hosts]
        self.arrived = self.used = 0

    def _frag(self, host: HostState) -> float:
        model = host.gpus[0].model if host.gpus else ""
        cpu_left = host.cpu_milli - host.cpu_used_milli
        return self.frag.amount(model, cpu_left, tuple(sorted(g.free_milli for g in host.gpus)))

    def record(self, pod: PodSpec, place: Place | None, seconds: float) -> None:
        self.arrived += pod.total_gpu_milli
        node, gpus = -1, tuple[int, ...]()
        if place is not None:
            node, host = self.hosts[place.host]
            index = {g.uuid: g.index for g in host.gpus}
            gpus = tuple(index[g.gpu_uuid] for g in place.grants)
            self.used += sum(g.milli_gpu for g in place.grants)
            self.frags[node] = self._frag(host)
        result = self.result
        result.node.append(node)
        result.gpus.append(gpus)
        result.arrived_milli.append(self.arrived)
        result.used_milli.append(self.used)
        result.frag_milli.append(sum(self.frags))
        result.decision_s.append(seconds)


def replay_offline(workload: Workload, policy_name: str = DEFAULT_POLICY) -> ReplayResult:
    """Ask the policy for each pod in turn and book what it says: no cycle around it."""
    started = time.perf_counter()
    snapshot = mirror_snapshot(workload.nodes)
    recorder = _Recorder(workload, snapshot)
    replay_offline_on(snapshot, get_policy(policy_name), workload.pods, recorder.record)
    recorder.result.wall_s = time.perf_counter() - started
    return recorder.result


def replay_offline_on(
    snapshot: Snapshot,
    policy: Policy,
    pods: list[PodSpec],
    record: Callable[[PodSpec, Place | None, float], None] | None = None,
) -> None:
    """Place ``pods`` one at a time on ``snapshot``, booking each placement in it."""
    gpus = {g.uuid: g for h in snapshot.hosts for g in h.gpus}
    hosts = {h.name: h for h in snapshot.hosts}
    for seq, pod in enumerate(pods):
        began = time.perf_counter()
        learn(policy, seq, pod)
        request = pod_request(seq, pod)
        decision = policy.place(snapshot, request)
        place = decision if isinstance(decision, Place) else None
        if place is not None:
            for grant in place.grants:
                book(gpus[grant.gpu_uuid], grant)
            hosts[place.host].take(request.cpu_milli, request.memory_mib)
            snapshot.changed(place.host)
        if record is not None:
            record(pod, place, time.perf_counter() - began)


def replay_live(
    workload: Workload, batch: int = DEFAULT_BATCH, policy_name: str = DEFAULT_POLICY
) -> ReplayResult:
    """Arrivals ``batch`` at a time, each batch one ``run_cycle`` on the kept fleet state.

    A pod's decision time is its cycle's wall time shared out over the batch.
    """
    started = time.perf_counter()
    snapshot = mirror_snapshot(workload.nodes)
    policy = get_policy(policy_name)
    recorder = _Recorder(workload, snapshot)
    for first, pods in _batches(workload.pods, batch):
        began = time.perf_counter()
        for seq, pod in enumerate(pods, first):
            learn(policy, seq, pod)
        queue = [pod_request(seq, pod) for seq, pod in enumerate(pods, first)]
        decisions = run_cycle(snapshot, queue, policy, now=float(first), in_place=True)
        placed = {d.request_id: d for d in decisions if isinstance(d, Place)}
        share = (time.perf_counter() - began) / len(pods)
        for seq, pod in enumerate(pods, first):
            recorder.record(pod, placed.get(seq), share)
    recorder.result.wall_s = time.perf_counter() - started
    return recorder.result


def result_of_placements(workload: Workload, placed: list[tuple[str, tuple[int, ...], int]]) -> ReplayResult:
    """The result of placements made elsewhere (the twin reads them from the portal's
    database): per pod of ``workload``, in order, its node's name ("" when none took it),
    its GPU indices and the milli-GPU it was granted in all. No fragmentation curve."""
    index = {node.name: n for n, node in enumerate(workload.nodes)}
    result = ReplayResult(workload)
    arrived = used = 0
    for pod, (node, gpus, milli) in zip(workload.pods, placed, strict=True):
        arrived += pod.total_gpu_milli
        used += milli
        result.node.append(index[node] if node else -1)
        result.gpus.append(gpus)
        result.arrived_milli.append(arrived)
        result.used_milli.append(used)
    return result


def _batches(pods: list[PodSpec], size: int) -> Iterator[tuple[int, list[PodSpec]]]:
    for first in range(0, len(pods), size):
        yield first, pods[first : first + size]
