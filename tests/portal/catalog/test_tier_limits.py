"""A tier's /dev/shm size and thread limit, from the console's form to the launch message."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.forms.models import model_to_dict

from portal.catalog.models import Tier
from portal.sandboxes.specs import launch_spec
from tests.factories import TierFactory
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


def test_a_sandbox_gets_its_tiers_shm_size_or_half_its_memory(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    """Docker's own /dev/shm is 64 MiB: PyTorch DataLoader workers died with a bus error."""
    tier = catalog["dedicated"]
    sandbox = request(people["owner"], people["project"], tier, catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    spec = launch_spec(sandbox)
    assert (tier.memory_limit_mib, tier.shm_size_mib, spec.shm_size_mib) == (256, 0, 128)
    Tier.objects.filter(pk=tier.pk).update(shm_size_mib=200)
    sandbox.refresh_from_db()
    assert launch_spec(sandbox).shm_size_mib == 200
    [(_, _, (sent,))] = [t for t in sent_tasks if t[1] == "launch_sandbox"]
    assert sent["shm_size_mib"] == 128 and sent["pids_limit"] == tier.pids_limit


def test_a_new_tier_allows_thousands_of_threads() -> None:
    """The pids cgroup counts threads; the old default of 512 stopped PyTorch with OpenMP."""
    assert Tier._meta.get_field("pids_limit").get_default() == 4096


def test_shm_larger_than_the_memory_limit_is_refused(people: Any, catalog: Any) -> None:
    admin = client_for(people["admin"])
    tier = catalog["dedicated"]
    fields = {k: v for k, v in model_to_dict(tier).items() if v is not None and k != "id"}
    fields.update(max_duration="8:00:00", isolation_levels=["container", "process"])
    saved = admin.post(f"/console/catalog/tiers/{tier.pk}/", {**fields, "shm_size_mib": 192})
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    assert Tier.objects.get(pk=tier.pk).shm_size_mib == 192
    refused = admin.post(f"/console/catalog/tiers/{tier.pk}/", {**fields, "shm_size_mib": 1024})
    assert refused.status_code == 400
    assert b"Shared memory cannot be larger than the memory limit" in refused.content
    assert b"Shared memory, /dev/shm (MiB)" in admin.get(f"/console/catalog/tiers/{tier.pk}/").content
    with pytest.raises(IntegrityError), transaction.atomic():
        TierFactory(slug="big-shm", shm_size_mib=300)  # memory 256: the database refuses it too
