"""Quotas per GPU model (scheduler/model_quotas.py, through the cycle; issue 40, item 2): a
request is narrowed to the models its project's limits leave it, waits naming the limit when
none is left, and what it and preempted sandboxes hold counts per limit."""

from __future__ import annotations

from scheduler.cluster import (
    DEDICATED,
    DeviceGrant,
    FairShareState,
    GpuState,
    HostState,
    ModelLimit,
    Pending,
    Place,
    ProjectShare,
    Request,
    Running,
    Snapshot,
)
from scheduler.cycle import run_cycle
from scheduler.placement import get_policy

H100, A100, H200 = "H100-80GB", "A100-80GB", "H200"


def host(name: str, model: str, gpus: int = 2, busy: int = 0) -> HostState:
    states = [
        GpuState(f"{name}-g{i}", name, i, model, 81559, "auto", exclusive_busy=i < busy) for i in range(gpus)
    ]
    return HostState(name, True, states, isolation_levels=("container",))


def fleet() -> Snapshot:
    return Snapshot([host("h100", H100, busy=1), host("a100", A100)])


def ask(request_id: int = 1, models: tuple[str, ...] = (), gpus: int = 1) -> Request:
    return Request(
        request_id, "vision", 1, 0.0, DEDICATED, gpu_count=gpus, gpu_models=models, isolation="container"
    )


def holding_h100_g0() -> Running:
    grant = DeviceGrant("h100-g0", "h100-g0", "exclusive", 1000)
    return Running(90, "vision", "h100", (grant,), preemptible=True)


def decide(snapshot: Snapshot, requests: list[Request], *limits: ModelLimit) -> list[object]:
    fairshare = FairShareState({"vision": ProjectShare(model_limits=limits)})
    snapshot.running.append(holding_h100_g0())
    return list(run_cycle(snapshot, requests, get_policy("gpushare"), 1.0, fairshare=fairshare))


def test_a_request_for_any_model_goes_to_the_model_under_its_limit() -> None:
    [place] = decide(fleet(), [ask()], ModelLimit(H100, frozenset({H100}), 1000))
    assert isinstance(place, Place) and place.host == "a100"


def test_a_request_naming_the_model_at_its_limit_waits_and_says_which_limit() -> None:
    [pending] = decide(fleet(), [ask(models=(H100,))], ModelLimit(H100, frozenset({H100}), 1000))
    assert isinstance(pending, Pending)
    assert pending.reason == (
        "quota: project vision holds 1 of its 1 H100-80GB GPU limit and this needs 1 more"
    )


def test_a_class_of_models_counts_them_together_and_each_placement_counts() -> None:
    snapshot = Snapshot([host("h100", H100, busy=1), host("h200", H200), host("a100", A100)])
    hopper = ModelLimit("Hopper", frozenset({H100, H200}), 2000)
    decisions = decide(snapshot, [ask(1, (H200,)), ask(2, (H200,)), ask(3)], hopper)
    first, second, third = decisions
    assert isinstance(first, Place) and first.host == "h200"
    assert isinstance(second, Pending) and "holds 2 of its 2 Hopper GPU limit" in second.reason
    assert isinstance(third, Place) and third.host == "a100"


def test_a_closed_limit_holds_its_models_back_whatever_is_held() -> None:
    used_up = ModelLimit(A100, frozenset({A100}), 8000, closed="quota: A100-80GB GPU-hours used up")
    [place, pending] = decide(fleet(), [ask(1), ask(2, (A100,))], used_up)
    assert isinstance(place, Place) and place.host == "h100"
    assert isinstance(pending, Pending) and pending.reason == "quota: A100-80GB GPU-hours used up"


def test_without_model_limits_nothing_changes() -> None:
    [place] = decide(fleet(), [ask(models=(H100,))])
    assert isinstance(place, Place) and place.host == "h100"


def test_a_request_kept_off_a_model_that_then_waits_says_why_it_was_kept_off() -> None:
    snapshot = Snapshot([host("h100", H100, busy=1), host("a100", A100, busy=2)])
    [pending] = decide(snapshot, [ask()], ModelLimit(H100, frozenset({H100}), 1000))
    assert isinstance(pending, Pending)
    assert pending.reason.endswith(
        "; not on H100-80GB: quota: project vision holds 1 of its 1 H100-80GB GPU limit and this needs 1 more"
    )
