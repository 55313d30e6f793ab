"""Projects: members and roles managed by project managers, usage and quota bars."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.accounts.models import Membership
from portal.audit.models import AuditEntry
from portal.billing.models import UsageRecord
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions
from portal.telemetry.models import SandboxRollup
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def test_projects_show_role_quota_bars_and_usage(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=2, max_gpus=4)
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    place_all()
    sandbox.refresh_from_db()
    actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "c"}, timezone.now())
    page = client_for(people["owner"]).get("/projects/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Vision" in text and "Project manager" in text and "NLP" not in text
    assert "Live sandboxes: 1 of 2" in text and 'aria-valuenow="50"' in text
    assert "GPUs held: 2 of 4" in text
    # Ten minutes held, one of them measured at 50 %: used, idle and unmeasured all show.
    now = timezone.now()
    UsageRecord.objects.filter(sandbox=sandbox).update(started_at=now - timedelta(minutes=10))
    minute = (now - timedelta(minutes=3)).replace(second=0, microsecond=0)
    SandboxRollup.objects.create(
        sandbox=sandbox, minute=minute, samples=60, mem_min_mib=0, mem_mean_mib=0, mem_max_mib=0,
        util_min_pct=50, util_mean_pct=50, util_max_pct=50, temp_max_c=50, power_mean_w=100,
    )  # fmt: skip
    detail = client_for(people["member"]).get("/projects/vision/")
    assert detail.status_code == 200 and b"GPU-hours allocated" in detail.content
    text = detail.content.decode()
    assert "Used 0.02 h" in text and "Idle 0.02 h" in text and "Unmeasured 0.30 h" in text, text
    assert "No invoice yet" in text
    assert b"Add member" not in detail.content  # a member reads, a manager changes
    assert client_for(people["outsider"]).get("/projects/vision/").status_code == 404


def test_managers_add_change_and_remove_members_but_keep_one_manager(
    people: Any, fleet: Any, sent_tasks: Any
) -> None:
    manager = client_for(people["owner"])
    url = "/projects/vision/members/"

    def flash(response: Any) -> str:
        return " ".join(str(m) for m in response.wsgi_request._messages)

    added = manager.post(url, {"action": "add", "username": "oscar", "role": "billing"})
    assert "oscar joined Vision as Billing viewer." in flash(added)
    oscar = Membership.objects.get(project=people["project"], user=people["outsider"])
    assert "already in Vision" in flash(
        manager.post(url, {"action": "add", "username": "oscar", "role": "member"})
    )
    assert "No user is called 'nobody'" in flash(
        manager.post(url, {"action": "add", "username": "nobody", "role": "member"})
    )
    changed = manager.post(url, {"action": "role", "membership": oscar.pk, "role": "member"})
    assert "oscar is now Member." in flash(changed)
    mine = Membership.objects.get(project=people["project"], user=people["owner"])
    refused = manager.post(url, {"action": "role", "membership": mine.pk, "role": "member"})
    assert "olivia is the project's last manager." in flash(refused)
    assert "last manager" in flash(manager.post(url, {"action": "remove", "membership": mine.pk}))
    assert "Member removed." in flash(manager.post(url, {"action": "remove", "membership": oscar.pk}))
    assert not Membership.objects.filter(user=people["outsider"], project=people["project"]).exists()
    assert Membership.objects.get(pk=mine.pk).role == "manager"
    assert (
        client_for(people["member"]).post(url, {"action": "remove", "membership": mine.pk}).status_code == 403
    )
    log = list(
        AuditEntry.objects.filter(target_type="accounts.membership")
        .order_by("pk")
        .values_list("action", "actor_name")
    )
    assert log == [("created", "olivia"), ("changed", "olivia"), ("deleted", "olivia")]


def test_a_monthly_gpu_hour_budget_refuses_new_requests_once_spent(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    from datetime import timedelta

    from portal.billing.models import UsageRecord
    from portal.quotas.usage import gpu_hours_since, month_start

    QuotaPolicy.objects.create(project=people["project"], max_gpu_hours_month=2)
    now = timezone.now()
    old = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])

    def record(started: Any, ended: Any, milli: int) -> None:
        UsageRecord.objects.create(
            sandbox=old, allocation_key=f"k{started.timestamp()}", project=people["project"],
            user=people["owner"],
            tier=catalog["dedicated"], gpu_model="H100-80GB", milli_gpu=milli, price_per_gpu_hour_micros=1,
            currency="EUR", started_at=started, ended_at=ended, duration=(ended - started) if ended else None,
        )  # fmt: skip

    record(month_start(now) - timedelta(hours=5), month_start(now) - timedelta(hours=1), 1000)  # last month
    record(now - timedelta(hours=3), now - timedelta(hours=1, minutes=30), 1000)  # 1.5 GPU-hours
    record(now - timedelta(minutes=30), None, 500)  # running: 0.25 so far
    assert abs(gpu_hours_since(people["project"].pk, month_start(now), now) - 1.75) < 0.01
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])  # 1.75 < 2: allowed
    assert "1.8 of its 2 GPU-hours this month" in str(
        list(people["owner"].notifications.filter(kind="quota").values_list("message", flat=True))
    )
    record(now - timedelta(minutes=37), now - timedelta(minutes=10), 1000)  # +0.45
    with pytest.raises(actions.SandboxRequestError) as refused:
        request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    assert refused.value.message == "Project Vision has used 2.2 of its 2 GPU-hours this month."
    page = client_for(people["owner"]).get("/projects/vision/").content.decode()
    assert "GPU-hours this month: 2.2 of 2" in page
