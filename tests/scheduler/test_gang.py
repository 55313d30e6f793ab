"""A multi-node request (scheduler/placement/gang.py, through the cycle): all or nothing on
hosts of one cluster, the fullest fitting hosts first, within the quota (issue 39)."""

from __future__ import annotations

from scheduler.cluster import (
    DEDICATED,
    FairShareState,
    GpuState,
    HostState,
    Pending,
    Place,
    ProjectShare,
    Request,
    Snapshot,
)
from scheduler.cycle import run_cycle
from scheduler.placement import get_policy


def host(name: str, gpus: int, busy: int = 0, cluster: str = "slurm") -> HostState:
    states = [
        GpuState(f"{name}-g{i}", name, i, "H100-80GB", 81559, "auto", exclusive_busy=i < busy)
        for i in range(gpus)
    ]
    return HostState(name, True, states, isolation_levels=("process",), cluster=cluster)


def gang(nodes: int = 2, gpus: int = 1, request_id: int = 1) -> Request:
    return Request(request_id, "vision", 1, 0.0, DEDICATED, gpu_count=gpus, nodes=nodes, isolation="process")


def decide(snapshot: Snapshot, request: Request, limit_milli: int | None = None) -> list[object]:
    fairshare = FairShareState({"vision": ProjectShare(limit_milli=limit_milli)})
    return list(
        run_cycle(snapshot, [request], get_policy("gpushare"), 1.0, fairshare=fairshare, in_place=True)
    )


def test_a_gang_takes_the_fullest_fitting_hosts_of_one_cluster() -> None:
    fleet = Snapshot([host("a", 4), host("b", 4, busy=3), host("c", 4, busy=2), host("solo", 8, cluster="")])
    [place] = decide(fleet, gang(nodes=2, gpus=1))
    assert isinstance(place, Place) and place.host == "b"
    assert [g.gpu_uuid for g in place.grants] == ["b-g3", "c-g2"]
    assert {g.host for h in fleet.hosts for g in h.gpus if g.exclusive_busy} >= {"b", "c"}


def test_a_gang_waits_whole_when_too_few_hosts_fit_or_the_quota_is_short() -> None:
    [pending] = decide(
        Snapshot([host("a", 4), host("b", 4, busy=4), host("solo", 8, cluster="")]), gang(nodes=2)
    )
    assert (
        isinstance(pending, Pending)
        and "needs 2 nodes of one cluster with 1 idle whole GPU of one model each" in pending.reason
    )
    [refused] = decide(Snapshot([host("a", 4), host("b", 4)]), gang(nodes=2, gpus=2), limit_milli=3000)
    assert isinstance(refused, Pending) and "quota" in refused.reason.lower()
