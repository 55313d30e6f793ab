"""Where the engine chose a sandbox's GPUs itself (Slurm binds a job's GRES), the launch
report names them and the allocations follow (portal/sandboxes/granted.py, issue 39): moved to
the granted GPU, swapped with a sandbox whose placement crossed this one's, and never moved to
a GPU of another host."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from portal.fleet.models import Gpu
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from tests.conftest import seed_host
from tests.portal.helpers import place_all, request

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db: Any) -> list[str]:
    """A Slurm node's four whole GPUs (dedicated: the test places whole GPUs only)."""
    seed_host("lab-n1", "H100-80GB:4", {i: "dedicated" for i in range(4)}, driver="slurm")
    return list(Gpu.objects.filter(host__name="lab-n1").order_by("index").values_list("uuid", flat=True))


def placed(people: Any, catalog: Any) -> Sandbox:
    sandbox = request(
        people["owner"], people["project"], catalog["dedicated"], catalog["image"], isolation="process"
    )
    place_all()
    sandbox.refresh_from_db()
    return sandbox


def gpus_of(sandbox: Sandbox) -> list[str]:
    return list(sandbox.allocations.filter(active=True).values_list("gpu__uuid", flat=True))


def running(sandbox: Sandbox, devices: list[str]) -> None:
    handle = {
        "driver": "slurm",
        "allocation_key": sandbox.allocation_key,
        "sandbox_id": sandbox.pk,
        "ref": "7",
    }
    actions.do_mark_running(sandbox.allocation_key, {**handle, "devices": devices}, timezone.now())


def test_the_allocation_follows_the_gpu_slurm_granted(people: Any, catalog: Any, node: list[str]) -> None:
    sandbox = placed(people, catalog)
    [was] = gpus_of(sandbox)
    granted = next(u for u in node if u != was)
    running(sandbox, [granted])
    assert gpus_of(sandbox) == [granted]
    assert sandbox.allocations.get(active=True).device_uuid == granted
    event = sandbox.events.get(to_state="running")
    assert "granted other GPUs of the node than placed" in event.message
    running(sandbox, [granted])  # a repeated report changes nothing
    assert gpus_of(sandbox) == [granted]


def test_two_placements_that_crossed_swap(people: Any, catalog: Any, node: list[str]) -> None:
    first, second = placed(people, catalog), placed(people, catalog)
    [a], [b] = gpus_of(first), gpus_of(second)
    running(first, [b])  # Slurm gave the first job the GPU gpushare booked for the second
    assert (gpus_of(first), gpus_of(second)) == ([b], [a])
    running(second, [a])  # and the second's report agrees with the swap
    assert (gpus_of(first), gpus_of(second)) == ([b], [a])


def test_a_gpu_of_another_host_is_never_followed(people: Any, catalog: Any, node: list[str]) -> None:
    seed_host("lab-n2", "H100-80GB:1", {0: "dedicated"}, driver="slurm")
    sandbox = placed(people, catalog)
    [was] = gpus_of(sandbox)
    running(sandbox, [Gpu.objects.get(host__name="lab-n2").uuid])
    assert gpus_of(sandbox) == [was] and Sandbox.objects.get(pk=sandbox.pk).state == "running"
