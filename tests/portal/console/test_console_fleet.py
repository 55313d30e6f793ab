"""The fleet page at a cluster's size: a page of hosts at a time, searched by host name,
filtered by GPU model and by host or GPU state, bad input answered on the form."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db.models import Max

from portal.console.views import HOSTS_PER_PAGE
from portal.fleet.models import Gpu, Host
from tests.conftest import seed_host
from tests.portal.helpers import client_for

pytestmark = pytest.mark.django_db
HOSTS = HOSTS_PER_PAGE + 5


@pytest.fixture
def many_hosts(db: Any) -> None:
    for i in range(HOSTS):
        seed_host(f"node-{i:03d}", "V100M32:8" if i % 3 else "T4:2")


def shown_hosts(html: str) -> list[str]:
    return re.findall(r'<h2>(node-\d+) <span class="state', html)


def test_the_fleet_comes_a_page_of_hosts_at_a_time(people: Any, many_hosts: Any) -> None:
    admin = client_for(people["admin"])
    first = admin.get("/console/fleet/").content.decode()
    assert shown_hosts(first) == [f"node-{i:03d}" for i in range(HOSTS_PER_PAGE)]
    assert f"{HOSTS} hosts, 1\u2013{HOSTS_PER_PAGE} shown" in first  # an en dash and "page 1 of 2" in first
    second = admin.get("/console/fleet/?page=2").content.decode()
    assert shown_hosts(second) == [f"node-{i:03d}" for i in range(HOSTS_PER_PAGE, HOSTS)]
    assert shown_hosts(admin.get("/console/fleet/?page=99").content.decode()) == shown_hosts(second)


def test_search_and_filters_narrow_hosts_and_gpus(people: Any, many_hosts: Any) -> None:
    admin = client_for(people["admin"])
    assert shown_hosts(admin.get("/console/fleet/?q=node-01").content.decode()) == [
        f"node-{i:03d}" for i in range(10, 20)
    ]
    t4 = admin.get("/console/fleet/?model=T4").content.decode()
    assert shown_hosts(t4) == [f"node-{i:03d}" for i in range(0, HOSTS, 3)][:HOSTS_PER_PAGE]
    assert "V100M32" not in re.sub(r"<select.*?</select>", "", t4, flags=re.S)  # only the T4s listed
    Host.objects.filter(name="node-004").update(state=Host.State.LOST)
    Gpu.objects.filter(host__name="node-007", index=3).update(state=Gpu.State.DRAINED, drain_reason="fan")
    assert shown_hosts(admin.get("/console/fleet/?state=lost").content.decode()) == ["node-004"]
    drained = admin.get("/console/fleet/?gpu_state=drained").content.decode()
    assert shown_hosts(drained) == ["node-007"] and drained.count('data-live-gpu="') == 1
    # The pages keep the search.
    assert 'href="?q=node&amp;page=2"' in admin.get("/console/fleet/?q=node").content.decode()


def test_a_bad_filter_is_a_form_error_not_a_500(people: Any, many_hosts: Any) -> None:
    page = client_for(people["admin"]).get("/console/fleet/?model=X999&state=gone")
    assert page.status_code == 400
    html = page.content.decode()
    assert "Select a valid choice. X999 is not one of the available choices." in html
    assert len(shown_hosts(html)) == HOSTS_PER_PAGE  # unfiltered meanwhile


def test_a_refused_mode_change_comes_back_on_its_hosts_page(people: Any, many_hosts: Any) -> None:
    last = Gpu.objects.filter(host__name=f"node-{HOSTS - 1:03d}").aggregate(i=Max("index"))["i"]
    gpu = Gpu.objects.get(host__name=f"node-{HOSTS - 1:03d}", index=last)
    page = client_for(people["admin"]).post(f"/console/gpus/{gpu.uuid}/mode/", {"mode": "nonsense"})
    assert page.status_code == 400
    assert shown_hosts(page.content.decode()) == [gpu.host.name]
