"""Loading the openb CSVs and building one seed's workload as the FGD paper does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from scheduler.research.trace import (
    NodeSpec,
    PodSpec,
    build_workload,
    load_nodes,
    load_pods,
    tune_pods,
    typical_pods,
)

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,"
    "qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)


def pod(name: str, cpu: int = 1000, num: int = 1, milli: int = 1000, mem: int = 1024) -> PodSpec:
    return PodSpec(name, cpu, mem, num, milli if num else 0, (), name)


class ScriptedRandom(random.Random):
    """Returns the given indices from ``randrange``, to steer the tune-up draws."""

    def __init__(self, picks: list[int]) -> None:
        super().__init__(0)
        self.picks = picks

    def randrange(self, *args: object, **kwargs: object) -> int:
        return self.picks.pop(0)


def test_loading_keeps_gpu_nodes_and_every_pod(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(NODE_HEADER + "n1,64000,262144,2,P100\ncpu1,96000,393216,0,\nn2,96000,393216,8,G2\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        POD_HEADER
        + "p1,6000,12288,1,460,,LS,Running,0,10,0\n"
        + "p2,4000,8192,0,0,,BE,Failed,0,,\n"  # CPU-only and failed: still a pod
        + "p3,8000,8192,2,1000,V100M16|V100M32|,LS,Pending,0,,\n"
        + "p4,8000,8192,1,1500,,LS,Running,0,,\n"  # gpu_milli is clamped to one GPU
    )
    assert [n.name for n in load_nodes(nodes)] == ["n1", "n2"]
    loaded = {p.name: p for p in load_pods(pods)}
    assert len(loaded) == 4
    assert (loaded["p2"].num_gpu, loaded["p2"].gpu_milli, loaded["p2"].total_gpu_milli) == (0, 0, 0)
    assert loaded["p3"].models == ("V100M16", "V100M32")
    assert loaded["p3"].resource_key == (8000, 1000, 2, "V100M16|V100M32")
    assert loaded["p4"].gpu_milli == 1000
    assert loaded["p1"].sharing and not loaded["p3"].sharing


def test_pods_without_a_spec_column_accept_any_model(tmp_path: Path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,8000,8192,4,1000\n")
    assert load_pods(pods) == [PodSpec("p1", 8000, 8192, 4, 1000, (), "p1")]


def test_tune_up_appends_named_clones_and_stops_on_the_per_gpu_test() -> None:
    two_gpu, share, cpu_only = pod("a", num=2), pod("b", milli=500), pod("c", num=0)
    originals = [two_gpu, share, cpu_only]
    # Total 2500, target 3600. A CPU-only clone adds nothing and passes; the 2-GPU pod
    # passes the quirky per-GPU test (2500 + 1000 <= 3600) but adds 2000; the share then
    # overshoots (4500 + 500 > 3600) and is rejected, ending the tune-up.
    tuned = tune_pods(originals, originals, 3600.0, ScriptedRandom([2, 0, 1]))
    assert [p.name for p in tuned] == ["a", "b", "c", "c-tuned-0", "a-tuned-1"]
    assert [p.source for p in tuned[3:]] == ["c", "a"]
    assert sum(p.total_gpu_milli for p in tuned) == 4500


def test_tune_down_drops_random_pods_until_the_target_fits() -> None:
    pods = [pod(f"p{i}") for i in range(10)]
    tuned = tune_pods(pods, pods, 6500.0, random.Random(1))
    assert len(tuned) == 6
    assert {p.name for p in tuned} < {p.name for p in pods}


def test_a_cpu_only_trace_is_not_inflated() -> None:
    pods = [pod("c0", num=0), pod("c1", num=0)]
    assert tune_pods(pods, pods, 1000.0, random.Random(0)) == pods


def test_typical_pods_cover_the_threshold_and_renormalise() -> None:
    pods = [pod(f"s{i}", milli=500) for i in range(6)]
    pods += [pod(f"c{i}", cpu=2000, num=0) for i in range(2)]
    pods += [pod("w0", num=2), pod("x0", cpu=9000, num=2)]
    typical = typical_pods(pods, threshold=0.8)
    # 6 + 2 = 8 of 10 pods reach 80%; the two singletons are left out.
    assert [(t.cpu_milli, t.gpu_milli, t.num_gpu) for t in typical] == [(1000, 500, 1), (2000, 0, 0)]
    assert [t.probability for t in typical] == [0.75, 0.25]
    # Equal counts rank the larger shape first.
    ranked = typical_pods(pods, threshold=1.0)
    assert [(t.cpu_milli, t.num_gpu) for t in ranked][2:] == [(9000, 2), (1000, 2)]


def test_workload_is_deterministic_per_seed() -> None:
    nodes = [NodeSpec(f"n{i}", 64000, 262144, 2, "P100") for i in range(5)]
    pods = [pod(f"p{i:02d}", milli=100 * (i % 9 + 1)) for i in range(10)]
    first, again = build_workload(nodes, pods, 42, 1.3), build_workload(nodes, pods, 42, 1.3)
    other = build_workload(nodes, pods, 43, 1.3)
    assert [p.name for p in first.pods] == [p.name for p in again.pods]
    assert first.priority == again.priority and first.rng_state == again.rng_state
    assert [p.name for p in first.pods] != [p.name for p in other.pods]
    assert sorted(first.priority) == list(range(5))
    originals = first.pods[:10]
    assert sorted(p.name for p in originals) == [p.name for p in pods]
    assert len(first.pods) > 10 and all("-tuned-" in p.name for p in first.pods[10:])
    assert sum(p.total_gpu_milli for p in first.pods) <= 1.3 * first.capacity_milli


def test_default_trace_has_the_papers_shape() -> None:
    root = Path(__file__).resolve().parents[3] / "shared" / "traces" / "openb"
    if not root.exists():
        pytest.skip("the openb trace is not checked out beside the repository")
    nodes = load_nodes(root / "openb_node_list_gpu_node.csv")
    pods = load_pods(root / "openb_pod_list_default.csv")
    workload = build_workload(nodes, pods, 42, 1.3)
    assert (len(nodes), workload.total_gpus, len(pods)) == (1213, 6212, 8152)
    assert len(workload.typical) == 35
    assert sum(p.total_gpu_milli for p in workload.pods) / workload.capacity_milli == pytest.approx(
        1.3, abs=0.002
    )
