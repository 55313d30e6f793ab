"""Sandbox lifecycle through portal.sandboxes.actions: events, allocations, usage, idempotency."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.billing.models import UsageRecord, cost_micros
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions, transitions
from portal.sandboxes.models import Allocation, Sandbox
from scheduler.cluster import DeviceGrant
from tests.portal.helpers import place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def states(sandbox: Sandbox) -> list[str]:
    return list(sandbox.events.values_list("to_state", flat=True))


def test_request_place_run_stop_records_every_transition(
    people: Any, catalog: Any, fleet: Any, sent_tasks: list[Any]
) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    assert sandbox.state == "queued"
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.host is not None
    # Either host has two idle GPUs; which one is the policy's call (it keeps the largest whole).
    assert sandbox.state == "starting" and sandbox.host.name in ("a100", "h100")
    [(queue, _task, (spec,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert queue == f"host.{sandbox.host.name}" and spec["allocation_key"] == sandbox.allocation_key
    assert len(spec["device_uuids"]) == 2 and spec["real_gpu"] is False
    started = timezone.now()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "abc"}, started)
    actions.do_request_stop(sandbox.pk, people["owner"])
    assert [t[1] for t in sent_tasks][-1] == "stop_sandbox"
    actions.do_mark_stopped(sandbox.allocation_key, started + timedelta(minutes=30))
    sandbox.refresh_from_db()
    assert states(sandbox) == ["requested", "queued", "placing", "starting", "running", "stopping", "stopped"]
    assert not Allocation.objects.filter(sandbox=sandbox, active=True).exists()
    [usage] = UsageRecord.objects.filter(sandbox=sandbox)
    assert usage.duration == timedelta(minutes=30) and usage.milli_gpu == 2000
    assert usage.cost_micros == 2_500_000  # 2.50/GPU-h x 2 GPUs x 0.5 h


def test_duplicate_reports_change_nothing(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = request(
        people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="1g.10gb"
    )
    place_all()
    sandbox.refresh_from_db()
    now = timezone.now()
    for _ in range(2):  # a broker may deliver a message twice
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, now)
    for _ in range(2):
        actions.do_mark_stopped(sandbox.allocation_key, now + timedelta(seconds=7))
    assert UsageRecord.objects.filter(sandbox=sandbox).count() == 1
    assert states(Sandbox.objects.get(pk=sandbox.pk)).count("running") == 1


def test_database_refuses_to_book_a_gpu_twice(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    first = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    second = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    first.refresh_from_db()
    taken = Allocation.objects.get(sandbox=first)
    Allocation.objects.filter(sandbox=second).delete()
    second.refresh_from_db()
    assert second.state == "starting"  # got another GPU
    # Force a stale decision onto the same GPU: the constraint refuses it, nothing is written.
    third = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    grant = DeviceGrant(taken.gpu.uuid, taken.gpu.uuid, "exclusive", 1000)
    assert actions.do_place(third.pk, "h100", (grant,)) is False
    third.refresh_from_db()
    assert third.state == "queued" and not third.allocations.exists()
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(
            sandbox=third, gpu=taken.gpu, kind="exclusive", device_uuid=taken.gpu.uuid, milli_gpu=1000
        )


def test_every_sharing_mode_is_placed_on_its_kind_of_device(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    owner, project, image = people["owner"], people["project"], catalog["image"]
    mig = request(owner, project, catalog["mig"], image, mig_profile="3g.40gb")
    mps = request(owner, project, catalog["mps"], image, mps_memory_mib=10240, mps_thread_pct=25)
    ts = request(owner, project, catalog["timeslice"], image)
    place_all()
    kinds = {a.sandbox_id: (a.kind, a.device_uuid[:4]) for a in Allocation.objects.all()}
    assert kinds == {mig.pk: ("mig", "MIG-"), mps.pk: ("mps", "GPU-"), ts.pk: ("timeslice", "GPU-")}
    mps_spec = next(a[0] for q, t, a in sent_tasks if t == "launch_sandbox" and a[0]["sandbox_id"] == mps.pk)
    assert mps_spec["mps"] == {"pipe_dir": "", "thread_pct": 25, "memory_mib": 10240}


def test_unplaceable_request_waits_with_a_reason(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = request(
        people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="7g.80gb"
    )
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "queued" and "7g.80gb" in sandbox.pending_reason


def test_a_vm_request_waits_for_a_host_that_runs_vms_and_lands_only_there(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    from tests.conftest import seed_host

    tier = catalog["dedicated"]
    tier.isolation_levels = ["container", "vm"]
    tier.save()
    sandbox = request(people["owner"], people["project"], tier, catalog["image"], isolation="vm")
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "queued"
    assert sandbox.pending_reason == "no GPU host that is up runs vm sandboxes"  # the fleet runs Docker
    seed_host("vmhost", "H100-80GB:1", driver="libvirt")
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "starting" and sandbox.host is not None and sandbox.host.name == "vmhost"
    [(_, _task, (spec,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert spec["isolation"] == "vm"


def test_a_vm_host_with_real_gpus_offers_no_gpu(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """Issue 18, finding 5: the libvirt driver refuses GPU passthrough, so a GPU request for a
    VM must wait rather than land on a VM host with real GPUs and fail at its launch."""
    from tests.conftest import seed_host

    tier = catalog["dedicated"]
    tier.isolation_levels = ["container", "vm"]
    tier.save()
    seed_host("vmhost", "H100-80GB:1", driver="libvirt", backend="nvml")
    sandbox = request(people["owner"], people["project"], tier, catalog["image"], isolation="vm")
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.state == "queued" and "vm" in sandbox.pending_reason
    assert not [t for t in sent_tasks if t[1] == "launch_sandbox"]


def test_stop_before_placement_ends_at_once(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = request(
        people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="7g.80gb"
    )
    actions.do_request_stop(sandbox.pk, people["owner"])
    sandbox.refresh_from_db()
    assert sandbox.state == "stopped" and not any(t[1] == "stop_sandbox" for t in sent_tasks)


def test_launch_failure_releases_devices(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    actions.do_fail(sandbox.pk, "launch failed: image missing")
    sandbox.refresh_from_db()
    assert sandbox.state == "failed" and "image missing" in sandbox.failure
    assert not Allocation.objects.filter(active=True).exists()


@pytest.mark.parametrize(
    ("tier", "kw", "field", "text"),
    [
        ("dedicated", {"gpu_count": 5}, "gpu_count", "1 to 4 GPUs"),
        ("mig", {"mig_profile": "9g.99gb"}, "mig_profile", "Unknown MIG profile"),
        ("mps", {"mps_memory_mib": 1024, "mps_thread_pct": 0}, "mps_thread_pct", "1 to 100"),
        ("dedicated", {"duration": timedelta(hours=9)}, "duration", "up to 8:00:00"),
    ],
)
def test_bad_requests_name_the_field(
    people: Any, catalog: Any, tier: str, kw: dict[str, Any], field: str, text: str
) -> None:
    with pytest.raises(actions.SandboxRequestError) as err:
        request(people["owner"], people["project"], catalog[tier], catalog["image"], **kw)
    assert err.value.field == field and text in err.value.message
    assert not Sandbox.objects.exists()


def test_outsider_cannot_request_in_another_project(people: Any, catalog: Any) -> None:
    with pytest.raises(actions.SandboxRequestError, match="not a member"):
        request(people["outsider"], people["project"], catalog["dedicated"], catalog["image"])


def test_quota_refusal_names_the_quota(people: Any, catalog: Any, sent_tasks: Any) -> None:
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=1)
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    with pytest.raises(actions.SandboxRequestError, match="quota of 1 live sandboxes"):
        request(people["member"], people["project"], catalog["dedicated"], catalog["image"])


def test_cost_is_integer_micro_units() -> None:
    assert cost_micros(2_500_000, 1000, 3_600_000_000) == 2_500_000
    assert cost_micros(700_000, 142, 1_000_000) == 28  # 0.7 x 0.142 / 3600 s, rounded
    assert cost_micros(1, 1, 1) == 0


def test_a_cycle_is_one_transaction(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the first placement undoes it: no half-committed cycle, no launch."""
    placed = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    request(people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="7g.80gb")

    def broken(reasons: dict[int, str]) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr(actions, "do_set_pending_reasons", broken)
    with pytest.raises(RuntimeError):
        place_all()
    placed.refresh_from_db()
    assert placed.state == "queued" and not placed.allocations.exists()
    assert not [t for t in sent_tasks if t[1] == "launch_sandbox"]


def test_a_batch_run_launches_its_own_command(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> None:
    from portal.sandboxes.forms import SandboxRequestForm
    from portal.sandboxes.specs import launch_spec

    base = {
        "project": people["project"].pk, "tier": catalog["dedicated"].pk, "image": catalog["image"].pk,
        "isolation": "container", "gpu_count": 1, "duration_hours": 1,
    }  # fmt: skip
    missing = SandboxRequestForm({**base, "run": "batch", "command": ""}, user=people["owner"])
    assert not missing.is_valid() and missing.errors["command"] == ["A batch run needs the command it runs."]
    unquoted = SandboxRequestForm({**base, "run": "batch", "command": "echo 'oops"}, user=people["owner"])
    assert not unquoted.is_valid() and "cannot be read" in unquoted.errors["command"][0]
    form = SandboxRequestForm(
        {**base, "run": "batch", "command": "python train.py --name 'run 1'"}, user=people["owner"]
    )
    assert form.is_valid() and form.request_obj is not None
    sandbox = actions.do_request_sandbox(people["owner"], form.request_obj)
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.batch and launch_spec(sandbox).command == ("python", "train.py", "--name", "run 1")
    interactive = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    interactive.refresh_from_db()
    assert not interactive.batch and launch_spec(interactive).command == tuple(catalog["image"].command)
    # No billing facts go to GPU hosts: the portal's billing computes every cost.
    assert not {"price_per_gpu_hour_micros", "milli_gpu"} & set(launch_spec(interactive).to_json())


def test_each_transition_is_one_log_line_once_committed(
    people: Any, catalog: Any, fleet: Any, sent_tasks: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """What `make run` shows of a sandbox: one line per transition, none for a rolled-back one."""
    with caplog.at_level(logging.INFO, logger="portal.sandboxes.transitions"):
        sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
        place_all()
        with transaction.atomic():
            locked = Sandbox.objects.select_for_update().get(pk=sandbox.pk)
            transitions.transition(locked, "failed", message="never committed")
            transaction.set_rollback(True)
    lines = [r.getMessage() for r in caplog.records if r.name == "portal.sandboxes.transitions"]
    assert lines[0] == f"sandbox {sandbox.pk}: requested → queued: waiting for the scheduler"
    assert lines[1].startswith(f"sandbox {sandbox.pk}: queued → placing")
    assert not any("never committed" in line for line in lines)
