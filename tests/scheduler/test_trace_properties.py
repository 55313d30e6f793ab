"""Property tests for trace replay: whatever the cluster and workload, no policy ever
over-commits a node's CPU, memory or a GPU's milli, nor ignores a pod's GPU model, and a
replay is a pure function of its seed. Checked against the trace's own numbers, not
against the simulator's bookkeeping."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.research.replay import POLICIES, replay
from scheduler.research.trace import NodeSpec, PodSpec, build_workload

MODELS = ("T4", "V100M16", "A10", "G2")


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeSpec]:
    count = draw(st.integers(1, 6))
    return [
        NodeSpec(
            name=f"node-{i}",
            cpu_milli=draw(st.sampled_from((8000, 32000, 64000, 96000))),
            memory_mib=draw(st.sampled_from((32768, 131072, 262144))),
            gpus=draw(st.integers(1, 8)),
            model=draw(st.sampled_from(MODELS)),
        )
        for i in range(count)
    ]


@st.composite
def pod_lists(draw: st.DrawFn) -> list[PodSpec]:
    pods = []
    for i in range(draw(st.integers(1, 30))):
        num_gpu = draw(st.sampled_from((0, 1, 1, 1, 2, 4)))
        milli = 0 if num_gpu == 0 else 1000 if num_gpu > 1 else draw(st.integers(50, 1000))
        models = () if num_gpu == 0 else tuple(draw(st.sets(st.sampled_from(MODELS), max_size=2)))
        pods.append(
            PodSpec(
                name=f"pod-{i:03d}",
                cpu_milli=draw(st.sampled_from((1000, 4000, 8000, 16000))),
                memory_mib=draw(st.sampled_from((2048, 8192, 32768))),
                num_gpu=num_gpu,
                gpu_milli=milli,
                models=tuple(sorted(models)),
                source=f"pod-{i:03d}",
            )
        )
    return pods


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=clusters(), pods=pod_lists(), seed=st.integers(0, 2**16), policy=st.sampled_from(sorted(POLICIES))
)
def test_no_policy_over_commits_anything(
    nodes: list[NodeSpec], pods: list[PodSpec], seed: int, policy: str
) -> None:
    workload = build_workload(nodes, pods, seed, 1.3)
    result = replay(workload, policy)
    cpu: dict[int, int] = defaultdict(int)
    memory: dict[int, int] = defaultdict(int)
    milli: dict[tuple[int, int], int] = defaultdict(int)
    for pod, n, gpus in zip(workload.pods, result.node, result.gpus, strict=True):
        if n < 0:
            continue
        node = workload.nodes[n]
        cpu[n] += pod.cpu_milli
        memory[n] += pod.memory_mib
        assert cpu[n] <= node.cpu_milli and memory[n] <= node.memory_mib, (policy, pod, node)
        if pod.num_gpu:
            assert not pod.models or node.model in pod.models
            assert len(set(gpus)) == pod.num_gpu and all(0 <= g < node.gpus for g in gpus)
        for g in gpus:
            milli[n, g] += pod.gpu_milli
            assert milli[n, g] <= 1000, (policy, pod, node)
    assert replay(build_workload(nodes, pods, seed, 1.3), policy).node == result.node
