"""The per-class failure count: what it counts, from placements alone, and its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.research.bench_classes import MULTI, ONE, SHARES, class_failures, failed_in, main, render
from scheduler.research.bench_live import Runs, classes_section
from scheduler.research.replay import main as replay_main
from scheduler.research.trace import PodSpec, build_workload, load_nodes, load_pods
from tests.scheduler.test_trace_replay import write_trace


def pod(num_gpu: int, milli: int) -> PodSpec:
    return PodSpec("p", 1000, 1024, num_gpu, milli, (), "p")


def test_each_class_counts_its_gpu_demand_that_failed_before_arrived_100() -> None:
    pods = [pod(2, 1000), pod(1, 1000), pod(1, 500), pod(0, 0), pod(1, 500), pod(4, 1000), pod(1, 1000)]
    failed = [True, False, True, True, False, True, True]
    # Capacity 4 GPUs: the demand before the 4 GPUs of the last two pods is 4,000 milli, so
    # they arrive at or after 100 % and do not count. The CPU-only pod has no GPU demand.
    assert class_failures(pods, failed, 4000) == {MULTI: 100.0, ONE: 0.0, SHARES: 50.0}


def test_the_cli_reads_where_pods_went_from_placements_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = write_trace(tmp_path)
    out = tmp_path / "out"
    common = ["--nodes", str(nodes), "--pods", str(pods), "--seed", "7", "--out", str(out)]
    replay_main(["--policy", "fgd", *common])
    main(["--nodes", str(nodes), "--pods", str(pods), "--seed", "7", str(out)])
    workload = build_workload(load_nodes(nodes), load_pods(pods), 7, 1.3)
    failed = failed_in(out / "placements.csv")
    shares = class_failures(workload.pods, failed, workload.capacity_milli)
    assert capsys.readouterr().out.split()[-2:] == ["shares", f"{shares[SHARES]:.2f}"]
    with pytest.raises(SystemExit):  # another seed's placements do not match the pods
        main(["--nodes", str(nodes), "--pods", str(pods), "--seed", "8", str(out)])


def test_the_table_marks_where_the_portal_fails_more_than_fgd() -> None:
    rows = {
        "openb_pod_list_cpu250": (
            {MULTI: 17.98, ONE: 4.5, SHARES: 3.9},
            {MULTI: 10.09, ONE: 7.1, SHARES: 6.5},
        ),
        "openb_pod_list_default": (
            {MULTI: 0.89, ONE: 4.2, SHARES: 3.7},
            {MULTI: 0.89, ONE: 5.4, SHARES: 4.9},
        ),
    }
    section = render(rows, [42, 43], "cmd")
    assert "| cpu250 | **17.98 / 10.09** | 4.50 / 7.10 | 3.90 / 6.50 |" in section
    assert "| default | 0.89 / 0.89 |" in section
    assert "no more than under FGD on 1 of 2 traces" in section


def test_bench_live_renders_the_class_medians_of_its_replays() -> None:
    ours, fgd = Runs(), Runs()
    ours.class_failed = {
        42: {MULTI: 10.0, ONE: 1.0},
        43: {MULTI: 20.0, ONE: 3.0},
        44: {MULTI: 12.0, ONE: 2.0},
    }
    fgd.class_failed = {42: {MULTI: 11.0, ONE: 4.0}, 43: {MULTI: 11.0, ONE: 4.0}, 44: {MULTI: 11.0, ONE: 4.0}}
    section = classes_section({"openb_pod_list_cpu250": {"gpushare": ours, "fgd": fgd}}, "cmd")
    assert section.startswith("<!-- bench:packing-classes:begin -->")
    assert "seeds 42-44" in section
    assert "| cpu250 | **12.00 / 11.00** | 2.00 / 4.00 | - |" in section
