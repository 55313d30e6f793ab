"""The replay loop and its CLI, on a small synthetic trace."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from scheduler.research.bench_markdown import write_section
from scheduler.research.bench_trace import (
    ALL_BEGIN,
    ALL_END,
    ANCHORS,
    BEGIN,
    END,
    TraceRuns,
    anchored_traces,
    bucket_curve,
    render,
    render_traces,
    unallocated,
)
from scheduler.research.paper import PAPER_POLICIES
from scheduler.research.paper.base import BestGpu, ReplayContext
from scheduler.research.paper.cluster import Cluster
from scheduler.research.replay import POLICIES, main, register_policy, replay
from scheduler.research.trace import NodeSpec, PodSpec, Workload, build_workload, load_nodes, load_pods
from tests.scheduler.test_trace_workload import POD_HEADER

NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,4,V100M16
n1,64000,262144,2,P100
n2,96000,393216,8,G2
n3,16000,65536,2,T4
cpu-only,96000,393216,0,
"""


def write_trace(tmp_path: Path) -> tuple[Path, Path]:
    shapes = [
        (6000, 12288, 1, 460, ""),
        (8000, 30000, 1, 500, "P100|T4"),
        (4000, 8192, 0, 0, ""),
        (16000, 65536, 2, 1000, ""),
        (12000, 24576, 1, 1000, "G2"),
        (2000, 4096, 1, 250, ""),
        (32000, 131072, 4, 1000, "V100M16"),
    ]
    rows = [
        f"pod-{i:03d},{cpu},{mem},{num},{milli},{spec},LS,Running,0,,"
        for i, (cpu, mem, num, milli, spec) in enumerate(shapes[i % len(shapes)] for i in range(12))
    ]
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_text(NODES)
    pods.write_text(POD_HEADER + "\n".join(rows) + "\n")
    return nodes, pods


@pytest.fixture
def workload(tmp_path: Path) -> Workload:
    nodes, pods = write_trace(tmp_path)
    return build_workload(load_nodes(nodes), load_pods(pods), 42, 1.3)


@pytest.mark.parametrize("policy", sorted(PAPER_POLICIES))
def test_a_pod_fails_only_when_no_node_can_take_it(workload: Workload, policy: str) -> None:
    result = replay(workload, policy)
    assert len(result.node) == len(workload.pods) and 0 < result.failed < len(workload.pods)
    # Re-apply the placements to a fresh cluster and check each decision against it.
    cluster = Cluster(workload.nodes)
    for pod, n, gpus in zip(workload.pods, result.node, result.gpus, strict=True):
        if n < 0:
            assert not any(cluster.fits(m, pod) for m in range(len(workload.nodes))), pod
            continue
        assert cluster.fits(n, pod)
        assert len(gpus) == pod.num_gpu and all(cluster.free[n][g] >= pod.gpu_milli for g in gpus)
        cluster.allocate(n, pod, gpus)
    assert result.used_milli[-1] == workload.capacity_milli - sum(map(sum, cluster.free))


@pytest.mark.parametrize("policy", sorted(PAPER_POLICIES))
def test_replay_is_deterministic_for_a_seed(workload: Workload, policy: str) -> None:
    first, again = replay(workload, policy), replay(workload, policy)
    assert (first.node, first.gpus, first.frag_milli) == (again.node, again.gpus, again.frag_milli)


def test_score_ties_go_to_the_smallest_priority() -> None:
    nodes = [NodeSpec(f"n{i}", 64000, 262144, 2, "P100") for i in range(6)]
    pods = [PodSpec("p", 1000, 1024, 1, 1000, (), "p")]
    for seed in (42, 43, 44):
        workload = build_workload(nodes, pods, seed, 0.1)
        assert replay(workload, "bestfit").node[0] == workload.priority.index(0)


def test_a_registered_policy_plugs_in_by_name(workload: Workload) -> None:
    class LastNode(BestGpu):
        name = "last-node"
        random_node = False

        def __init__(self, ctx: ReplayContext) -> None:
            super().__init__(ctx)

        def score(self, n: int, pod: PodSpec) -> int:
            return n

    register_policy("last-node", LastNode)
    try:
        result = replay(workload, "last-node")
        empty, first = Cluster(workload.nodes), workload.pods[0]
        assert result.node[0] == max(n for n in range(len(workload.nodes)) if empty.fits(n, first))
    finally:
        del POLICIES["last-node"]


def test_cli_writes_the_curve_and_the_placements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = write_trace(tmp_path)
    out = tmp_path / "out"
    main(
        [
            "--nodes",
            str(nodes),
            "--pods",
            str(pods),
            "--policy",
            "fgd",
            "--seed",
            "7",
            "--tune",
            "1.3",
            "--out",
            str(out),
        ]
    )
    assert "p50" in capsys.readouterr().out
    with (out / "curve.csv").open() as f:
        curve = list(csv.DictReader(f))
    with (out / "placements.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["seq", "pod", "source", "node", "gpus", "milli_per_gpu"]
        placements = list(reader)
    assert list(curve[0]) == ["arrived_pct", "allocated_pct", "frag_pct"]
    assert len(curve) == len(placements) > 12
    assert float(curve[-1]["arrived_pct"]) == pytest.approx(130, abs=8)
    assert [int(p["seq"]) for p in placements] == list(range(len(placements)))
    clones = [p for p in placements if "-tuned-" in p["pod"]]
    assert clones and all(p["pod"].startswith(p["source"] + "-tuned-") for p in clones)
    for p in placements:
        if p["node"]:
            assert p["node"] in {"n0", "n1", "n2", "n3"}
            assert all(g.isdigit() for g in p["gpus"].split(";")) or p["gpus"] == ""
        else:
            assert p["gpus"] == ""
    assert any(not p["node"] for p in placements) and any(";" in p["gpus"] for p in placements)


def test_buckets_follow_the_papers_merge() -> None:
    curve = bucket_curve([0.4, 0.6, 1.5, 2.5, 5.2], [0.1, 0.3, 1.004, 2.0, 4.0])
    assert curve[0] == 0.1  # 0.4 rounds to 0
    assert curve[1] == 0.3  # 0.6 rounds to 1
    assert curve[2] == 1.5  # 1.5 and 2.5 both round half to even: 2
    assert curve[3] == 1.5  # empty: borrows buckets 2 and 4
    assert curve[5] == 4.0 and curve[7] is None
    assert unallocated({42: curve, 43: curve, 44: [None] * 131}, 5) == 96.0


def test_bench_section_compares_with_the_paper_and_replaces_itself(tmp_path: Path) -> None:
    if not (ANCHORS / "fgd_alloc_by_arrived.csv").exists():
        pytest.skip("the anchors are not checked out beside the repository")
    flat: list[float | None] = [95.0] * 131
    section = render("openb_pod_list_default", {"fgd": {42: flat, 43: flat}}, {"fgd": [1.0, 2.0]}, 2)
    assert section.startswith(BEGIN) and section.endswith(END)
    assert (
        "| fgd | 5.00 | 10.00 | 5.00 | 4.77 | +0.23 | 5.00 | 4.60 | 5.00 ± 0.00 | 4.77 ± 0.11 | 1.50 |"
        in section
    )
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n<!-- bench:cycle:begin -->\ncycle\n<!-- bench:cycle:end -->\n")
    write_section(path, section)
    write_section(path, section)
    text = path.read_text()
    assert text.count(BEGIN) == 1 and "cycle\n" in text


def test_all_traces_section_has_a_row_per_trace_and_counts_wins() -> None:
    if not (ANCHORS / "fgd_unallocated_at_100.csv").exists():
        pytest.skip("the anchors are not checked out beside the repository")
    assert len(anchored_traces()) == 17
    worse: list[float | None] = [95.0] * 131
    better: list[float | None] = [96.0] * 131
    runs = {
        w: {
            "fgd": TraceRuns({42: worse}, [1.0], [0.1], [0.5]),
            "ours": TraceRuns({42: better}, [2.0], [0.2], [0.9]),
        }
        for w in ("openb_pod_list_default", "openb_pod_list_cpu050")
    }
    section = render_traces(runs, "python -m scheduler.research.bench_trace --all-traces", 2)
    assert section.startswith(ALL_BEGIN) and section.endswith(ALL_END)
    assert "| default | 5.00 | 4.00 | 5.00 | 4.00 | 5.00 | 4.00 | 4.77 | -1.00 |" in section
    assert "| ours | 2 of 2 | 2.00 (2.00) | 0.200 | 0.900 |" in section


def test_the_live_engine_is_timed_beside_the_papers_policies(tmp_path: Path) -> None:
    """bench_trace's gpushare-live row: the portal's cycle on the same workload as fgd's row,
    with no paper figures to compare against."""
    from scheduler.research.bench_trace import LIVE, run_matrix

    nodes, pods = write_trace(tmp_path)
    curves, walls = run_matrix(nodes, pods, ["fgd", LIVE], (42, 43), workers=1)
    assert set(curves[LIVE]) == {42, 43} and len(walls[LIVE]) == 2
    if (ANCHORS / "fgd_alloc_by_arrived.csv").exists():
        section = render("openb_pod_list_default", curves, walls, 1)
        [row] = [line for line in section.splitlines() if line.startswith(f"| {LIVE} |")]
        assert row.count("| - |") >= 4  # the paper has no gpushare: its columns stay empty
