"""A tier's rule for a sandbox that holds more GPU memory than its share: warn only, or stop
after a grace, set on the console's tier form with errors that say what is wrong."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
from django.db import IntegrityError, transaction
from django.forms.models import model_to_dict

from portal.catalog.models import OverShare, Tier
from tests.factories import TierFactory
from tests.portal.helpers import client_for

pytestmark = [pytest.mark.django_db]


def tier_fields(tier: Tier) -> dict[str, Any]:
    fields = {k: v for k, v in model_to_dict(tier).items() if v is not None and k != "id"}
    fields.update(max_duration="8:00:00", isolation_levels=["container", "process"])
    return fields


def test_a_new_tier_stops_a_sandbox_two_minutes_over_its_share() -> None:
    """Stop protects the neighbours: warn-only lets one tenant take the others' memory."""
    tier = cast(Tier, TierFactory(slug="mps", sharing_mode="mps"))
    assert (tier.over_share, tier.over_share_grace) == (OverShare.STOP, timedelta(minutes=2))
    assert tier.over_share_rule == (
        "over its GPU memory share, its owner is warned at once and it is stopped after 2 min "
        "if it stays over"
    )
    dedicated = cast(Tier, TierFactory(slug="dedicated"))
    assert dedicated.over_share_rule == ""  # a GPU of its own: no share to be over


def test_the_console_sets_the_rule_and_refuses_a_grace_out_of_range(people: Any, catalog: Any) -> None:
    admin = client_for(people["admin"])
    tier = catalog["timeslice"]
    url = f"/console/catalog/tiers/{tier.pk}/"
    assert b"Over its GPU memory share: grace before the stop" in admin.get(url).content
    saved = admin.post(url, {**tier_fields(tier), "over_share": "warn", "over_share_grace": "0:05:00"})
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    tier.refresh_from_db()
    assert (tier.over_share, tier.over_share_grace) == ("warn", timedelta(minutes=5))
    assert tier.over_share_rule == "over its GPU memory share, its owner is warned (it keeps running)"

    too_long = admin.post(url, {**tier_fields(tier), "over_share_grace": "2:00:00"})
    assert too_long.status_code == 400
    assert b"At most 1 h: while a sandbox is over its GPU memory share" in too_long.content
    negative = admin.post(url, {**tier_fields(tier), "over_share_grace": "-0:01:00"})
    assert negative.status_code == 400
    assert b"The grace cannot be negative." in negative.content
    unknown = admin.post(url, {**tier_fields(tier), "over_share": "kill"})
    assert unknown.status_code == 400
    assert b"Select a valid choice" in unknown.content
    tier.refresh_from_db()
    assert tier.over_share_grace == timedelta(minutes=5)


def test_the_database_refuses_a_grace_over_an_hour() -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        TierFactory(slug="long-grace", sharing_mode="mps", over_share_grace=timedelta(hours=2))
