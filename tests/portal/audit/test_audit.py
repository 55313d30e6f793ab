"""The audit log: admin changes and changes made on someone's behalf, before and after,
readable in the console, and impossible to rewrite."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from portal.audit.models import AuditEntry
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import Gpu
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from tests.portal.helpers import client_for, place_all, request
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def test_admin_changes_are_recorded_with_before_and_after(people: Any, fleet: Any, sent_tasks: Any) -> None:
    admin = client_for(people["admin"])
    added = admin.post(
        "/admin/quotas/quotapolicy/add/",
        {
            "project": people["project"].pk,
            "max_live_sandboxes": 5,
            "max_gpus": 4,
            "guaranteed_gpus": "1",
            "weight": 2,
        },
    )
    assert added.status_code == 302 and QuotaPolicy.objects.filter(project=people["project"]).exists()
    [created] = AuditEntry.objects.filter(target_type="quotas.quotapolicy")
    assert (created.action, created.actor_name, created.before) == ("created", "ada", None)
    assert created.after is not None and created.after["max_gpus"] == 4

    gpu = Gpu.objects.filter(host__name="h100", index=2).get()
    assert admin.post(f"/console/gpus/{gpu.uuid}/drain/", {"reason": "fan noise"}).status_code == 302
    [drained] = AuditEntry.objects.filter(target_type="fleet.gpu")
    assert ("state", "available", "drained") in drained.changes
    assert ("drain_reason", "", "fan noise") in drained.changes

    # What agents report (no person behind it) is not an admin change.
    gpus = SimulatedBackend("h100", parse_sim_spec("H100-80GB:4:mig=0,1")).list_gpus()
    do_sync_inventory("h100", "simulated", "docker", [g.to_json() for g in gpus])
    assert AuditEntry.objects.count() == 2

    page = admin.get("/console/audit/?target=fleet.gpu")
    assert page.status_code == 200 and b"fan noise" in page.content and b"quotapolicy" in page.content
    assert page.content.count(b'<tr><td class="small">') == 1  # filtered to the GPU's entry
    assert client_for(people["owner"]).get("/console/audit/").status_code == 302


def test_changes_to_someone_elses_sandbox_are_recorded_and_ones_own_are_not(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    mine = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    theirs = request(
        people["owner"],
        people["project"],
        catalog["dedicated"],
        catalog["image"],
        duration=timedelta(hours=1),
    )
    place_all()
    for sandbox in (mine, theirs):
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    actions.do_request_stop(mine.pk, people["owner"])
    actions.do_extend(theirs.pk, people["admin"], timedelta(hours=1))
    actions.do_request_stop(theirs.pk, people["admin"], "draining the host")
    entries = list(
        AuditEntry.objects.order_by("pk").values_list("action", "actor_name", "target_id", "message")
    )
    assert entries == [
        ("sandbox.extended", "ada", str(theirs.pk), ""),
        ("sandbox.stopping", "ada", str(theirs.pk), "draining the host"),
    ]
    stop = AuditEntry.objects.get(action="sandbox.stopping")
    assert (stop.before, stop.after) == ({"state": "running"}, {"state": "stopping"})


def test_the_log_cannot_be_rewritten(people: Any, fleet: Any, sent_tasks: Any) -> None:
    client_for(people["admin"]).post(f"/console/gpus/{Gpu.objects.first().uuid}/drain/", {"reason": "x"})  # type: ignore[union-attr]
    entry = AuditEntry.objects.get()
    written = entry.message
    entry.message = "nothing happened"
    with pytest.raises(PermissionError, match="append-only"):
        entry.save()
    with pytest.raises(PermissionError, match="append-only"):
        entry.delete()
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("UPDATE console_auditentry SET message = 'rewritten'")
    if connection.vendor == "postgresql":
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute("DELETE FROM console_auditentry")
    assert AuditEntry.objects.get().message == written
