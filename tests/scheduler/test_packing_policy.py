"""The live default policy packs: it keeps whole hosts and whole GPUs free."""

from __future__ import annotations

from typing import Any

from scheduler.cluster import GpuState, HostState, MigSlot, Place, Request, Snapshot
from scheduler.cycle import run_cycle
from scheduler.placement import get_policy

PACKING = get_policy("gpushare")


def gpu(host: str, index: int, mode: str = "dedicated", **kw: Any) -> GpuState:
    return GpuState(
        uuid=f"GPU-{host}-{index}",
        host=host,
        index=index,
        model="H100-80GB",
        memory_mib=81559,
        mode=mode,
        **kw,
    )


def req(id: int, mode: str = "dedicated", **kw: Any) -> Request:
    return Request(id=id, project="p", priority=100, submitted_at=float(id), mode=mode, **kw)


def placed_on(snapshot: Snapshot, request: Request) -> list[str]:
    decision = PACKING.place(snapshot, request)
    assert isinstance(decision, Place)
    return [g.device_uuid for g in decision.grants]


def test_dedicated_keeps_the_emptiest_host_whole() -> None:
    snapshot = Snapshot(
        hosts=[
            HostState("a", True, [gpu("a", i) for i in range(4)]),
            HostState("b", True, [gpu("b", 0, exclusive_busy=True), gpu("b", 1), gpu("b", 2)]),
        ]
    )
    assert placed_on(snapshot, req(1, gpu_count=2)) == ["GPU-b-1", "GPU-b-2"]
    first_fit = get_policy("first-fit").place(snapshot, req(1, gpu_count=2))
    assert isinstance(first_fit, Place) and first_fit.host == "a"  # what packing avoids


def test_mps_fills_a_partly_used_gpu_first() -> None:
    snapshot = Snapshot(
        hosts=[
            HostState(
                "a",
                True,
                [
                    gpu("a", 0, "mps"),
                    gpu("a", 1, "mps", mps_used_threads=50, mps_used_mib=20000),
                ],
            )
        ]
    )
    assert placed_on(snapshot, req(1, "mps", mps_memory_mib=10000, mps_thread_pct=25)) == ["GPU-a-1"]


def test_mig_fills_the_fuller_gpu_first() -> None:
    def slots(busy: int) -> list[MigSlot]:
        return [MigSlot(f"MIG-{busy}-{s}", "1g.10gb", s, 1, busy=s < busy) for s in range(7)]

    snapshot = Snapshot(
        hosts=[
            HostState(
                "a",
                True,
                [
                    gpu("a", 0, "mig", mig=slots(0)),
                    gpu("a", 1, "mig", mig=slots(5)),
                ],
            )
        ]
    )
    assert placed_on(snapshot, req(1, "mig", mig_profile="1g.10gb")) == ["MIG-5-5"]


def test_timeslice_fills_the_fuller_gpu_first() -> None:
    snapshot = Snapshot(
        hosts=[
            HostState(
                "a",
                True,
                [
                    gpu("a", 0, "timeslice", replicas=4),
                    gpu("a", 1, "timeslice", replicas=4, replicas_used={0, 1}),
                ],
            )
        ]
    )
    assert placed_on(snapshot, req(1, "timeslice")) == ["GPU-a-1"]


def test_packing_leaves_room_that_first_fit_would_have_broken_up() -> None:
    """Two single-GPU requests then a 4-GPU one: packing keeps a host whole for it."""

    def fleet() -> Snapshot:
        return Snapshot(
            hosts=[
                HostState("a", True, [gpu("a", i) for i in range(4)]),
                HostState(
                    "b", True, [gpu("b", 0, exclusive_busy=True), gpu("b", 1), gpu("b", 2), gpu("b", 3)]
                ),
            ]
        )

    queue = [req(1), req(2), req(3, gpu_count=4)]
    packed = run_cycle(fleet(), queue, PACKING, now=0)
    spread = run_cycle(fleet(), queue, get_policy("first-fit"), now=0)
    assert all(isinstance(d, Place) for d in packed)
    assert not isinstance(spread[2], Place)


def test_a_request_goes_only_to_a_host_of_its_isolation_level() -> None:
    from scheduler.cluster import Pending

    snapshot = Snapshot(
        hosts=[
            HostState("docker", True, [gpu("docker", 0)], isolation_levels=("container",)),
            HostState(
                "vm", True, [gpu("vm", 0, exclusive_busy=True), gpu("vm", 1)], isolation_levels=("vm",)
            ),
        ]
    )
    for policy in (PACKING, get_policy("first-fit")):
        for isolation, host in (("vm", "vm"), ("container", "docker"), ("", "docker")):  # "": any
            decision = policy.place(snapshot, req(1, isolation=isolation))
            assert isinstance(decision, Place) and decision.host == host, (policy.name, isolation)
        refused = policy.place(snapshot, req(2, isolation="process"))
        assert (
            isinstance(refused, Pending) and refused.reason == "no GPU host that is up runs process sandboxes"
        )
    snapshot.hosts[1].gpus[1].exclusive_busy = True
    waiting = PACKING.place(snapshot, req(3, isolation="vm"))
    assert isinstance(waiting, Pending) and "waiting for 1 free GPU on one host (at most 0" in waiting.reason
