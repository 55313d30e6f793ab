"""Admin console pages beyond the fleet and plans: the queue."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def test_the_queue_lists_waiting_requests_in_the_schedulers_order_with_reasons(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    waiting = [
        request(people["owner"], people["project"], catalog["mig"], catalog["image"], mig_profile="7g.80gb")
        for _ in range(3)
    ]
    place_all()
    page = client_for(people["admin"]).get("/console/queue/")
    assert page.status_code == 200
    listed = [int(pk) for pk in re.findall(rb'<td><a href="/sandboxes/(\d+)/">', page.content)]
    assert listed == [s.pk for s in waiting]  # same project and priority: oldest first
    assert b"no MIG instance of profile 7g.80gb exists in the fleet" in page.content
    assert client_for(people["owner"]).get("/console/queue/").status_code == 302


def test_admins_edit_the_catalog_and_quotas_from_the_console(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    from django.forms.models import model_to_dict

    from portal.audit.models import AuditEntry
    from portal.catalog.models import Tier
    from portal.quotas.models import QuotaPolicy

    admin = client_for(people["admin"])
    tier = catalog["dedicated"]
    fields = {k: v for k, v in model_to_dict(tier).items() if v is not None and k != "id"}
    fields.update(price_per_gpu_hour_micros=3_000_000, idle_util_pct=5, max_duration="8:00:00")
    fields["isolation_levels"] = ["container", "process"]
    saved = admin.post(f"/console/catalog/tiers/{tier.pk}/", fields)
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    tier.refresh_from_db()
    assert tier.price_per_gpu_hour_micros == 3_000_000 and tier.idle_util_pct == 5
    [entry] = AuditEntry.objects.filter(target_type="catalog.tier")
    assert ("price_per_gpu_hour_micros", 2_500_000, 3_000_000) in entry.changes and entry.actor_name == "ada"

    refused = admin.post(f"/console/catalog/tiers/{tier.pk}/", {**fields, "price_per_gpu_hour_micros": -1})
    assert refused.status_code == 400 and b"A price cannot be negative." in refused.content
    assert Tier.objects.get(pk=tier.pk).price_per_gpu_hour_micros == 3_000_000

    quota = {"project": people["project"].pk, "max_live_sandboxes": 3, "max_gpus": 2, "guaranteed_gpus": "1"}
    assert admin.post("/console/catalog/quotas/new/", {**quota, "weight": 2}).status_code == 302
    assert QuotaPolicy.objects.get(project=people["project"]).weight == 2
    over = admin.post("/console/catalog/quotas/new/", {**quota, "project": people["other_project"].pk,
                                                        "guaranteed_gpus": "5", "weight": 1})  # fmt: skip
    assert over.status_code == 400 and b"The guarantee must be between 0 and the limit." in over.content
    page = admin.get("/console/catalog/")
    assert (
        b"3.00 EUR/GPU-h" in page.content and b"stopped when GPU utilization stays under 5%" in page.content
    )
    assert admin.get("/console/catalog/nothing/new/").status_code == 404
