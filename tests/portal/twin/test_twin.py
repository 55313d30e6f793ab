"""The twin's parts (portal/twin/): pods turned into requests through the request form,
what it reads back, the independent feasibility check, the departures' timeline. The whole
twin, processes and all, runs in tests/e2e/test_twin.py."""

from __future__ import annotations

from typing import Any

import pytest

from portal.fleet.models import Gpu
from portal.sandboxes.models import Allocation, Sandbox
from portal.twin import arrivals, departures
from portal.twin.population import LONGEST, populate
from portal.twin.report import feasibility_problems
from scheduler.research.live_replay import result_of_placements
from scheduler.research.trace import NodeSpec, PodSpec, Workload
from tests.conftest import seed_host
from tests.portal.helpers import place_all

NODES = [NodeSpec("n1", 8000, 65536, 2, "T4"), NodeSpec("n2", 16000, 131072, 2, "V100M32")]
WHOLE = PodSpec("whole", 4000, 8192, 1, 1000, (), "whole")
PAIR = PodSpec("pair", 2000, 4096, 2, 1000, (), "pair")
SHARE = PodSpec("share", 1000, 2048, 1, 460, (), "share")
CPU = PodSpec("cpu", 2000, 4096, 0, 0, (), "cpu")
PODS = [WHOLE, PAIR, SHARE, CPU]
BIG = PodSpec("big", 64000, 8192, 1, 1000, (), "big")  # more CPU than any node has


@pytest.fixture
def twin_fleet(db: Any) -> Any:
    seed_host("n1", "T4:2")
    seed_host("n2", "V100M32:2")
    return populate([*PODS, BIG], NODES, {"T4": 15109, "V100M32": 32510}, project_count=2)


def test_each_pod_becomes_the_request_its_shape_makes(
    twin_fleet: Any, sent_tasks: Any, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        ids = arrivals.request_pods(twin_fleet, list(enumerate(PODS)), lambda _pod: LONGEST)
    by_seq = {seq: Sandbox.objects.select_related("tier").get(pk=pk) for pk, seq in ids.items()}
    whole, pair, share, cpu = (by_seq[i] for i in range(4))
    assert (whole.tier.sharing_mode, whole.gpu_count, whole.tier.cpu_limit) == ("dedicated", 1, 4.0)
    assert (pair.gpu_count, pair.tier.memory_limit_mib) == (2, 4096)
    # 46 % of the threads, and of the smallest GPU's memory in whole GiB, rounded down.
    assert (share.tier.sharing_mode, share.mps_thread_pct, share.mps_memory_mib) == ("mps", 46, 6 * 1024)
    assert cpu.tier.sharing_mode == "cpu" and whole.max_duration == LONGEST
    assert {s.project.slug for s in by_seq.values()} == {"twin-0", "twin-1"}
    # Four requests in one transaction: one cycle asked for.
    assert [t for t in sent_tasks if t[1] == "schedule_cycle"] == [("control", "schedule_cycle", ())]


def test_placements_and_withdrawals_read_back_from_the_rows(twin_fleet: Any, sent_tasks: Any) -> None:
    ids = arrivals.request_pods(twin_fleet, list(enumerate([*PODS, BIG])), lambda _pod: LONGEST)
    place_all()
    arrivals.wait_decided(list(ids), 5, lambda: [])
    assert arrivals.give_up_waiting(list(ids), twin_fleet, "no host") == [max(ids)]
    placed = arrivals.placements(ids)
    assert [p.seq for p in placed] == [0, 1, 2, 3, 4]
    assert placed[4].host == "" and placed[3].gpus == () and placed[3].host in {"n1", "n2"}
    assert len(placed[1].gpus) == 2 and placed[1].milli == (1000, 1000) and placed[2].milli == (460,)
    assert feasibility_problems(NODES) == []
    workload = Workload(NODES, [*PODS, BIG], [0, 1], [], 4000, ())
    result = result_of_placements(workload, [(p.host, p.gpus, sum(p.milli)) for p in placed])
    assert result.failed == 1 and result.used_milli[-1] == 1000 + 2000 + 460


def test_the_feasibility_check_reads_the_rows_not_the_scheduler(twin_fleet: Any, sent_tasks: Any) -> None:
    ids = arrivals.request_pods(twin_fleet, list(enumerate(PODS)), lambda _pod: LONGEST)
    place_all()
    share = next(pk for pk, seq in ids.items() if seq == 2)
    whole = next(pk for pk, seq in ids.items() if seq == 0)
    gpu = Allocation.objects.get(sandbox_id=whole).gpu
    # A share booked onto the whole GPU behind the scheduler's back, and too much CPU.
    Allocation.objects.filter(sandbox_id=share).update(gpu=gpu)
    Sandbox.objects.filter(pk=share).update(host=gpu.host)
    smaller = [NodeSpec(n.name, 1000, n.memory_mib, n.gpus, n.model) for n in NODES]
    problems = feasibility_problems(smaller)
    assert any(f"GPU #{gpu.index}: 1460 milli granted" in p for p in problems)
    assert any("a whole-GPU grant shared" in p for p in problems)
    assert any("milli-CPU held, 1000 there" in p for p in problems)
    assert Gpu.objects.count() == 4


def test_the_departures_timeline_plays_the_trace_on_its_clock() -> None:
    pods = [PodSpec(f"p{i}", 1000, 1024, 1, 1000, (), f"p{i}") for i in range(4)]
    times = {"p0": (0, 50_000), "p1": (86_400, 90_000), "p2": (100_000, 500_000), "p3": (200_000, 300_000)}
    events = departures.schedule(pods, times, start_s=86_400, end_s=172_800, speed=100.0)
    # p0 ended before the window; p1 arrives as it opens and leaves within it; p2 outlives
    # it; p3 comes after it.
    assert events == [
        (0.0, departures.ARRIVE, 1),
        (36.0, departures.DEPART, 1),
        (136.0, departures.ARRIVE, 2),
    ]
    assert [departures.request_class(p) for p in PODS] == ["one GPU", "multi-GPU", "share", "CPU-only"]
