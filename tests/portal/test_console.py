"""Admin console pages beyond the fleet and plans: the queue."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.portal.helpers import client_for, place_all, request

pytestmark = pytest.mark.django_db(transaction=True)


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
