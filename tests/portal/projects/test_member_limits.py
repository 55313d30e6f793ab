"""A member's own GPU limit inside a project (issue 40, item 4): set by the project's
managers on its page, audited, and enforced when a request is made, counting what the
member's sandboxes there hold and wait for."""

from __future__ import annotations

from typing import Any

import pytest

from portal.accounts.models import Membership
from portal.audit.models import AuditEntry
from portal.sandboxes import actions
from portal.scheduling.preview import preview_request
from tests.factories import TierFactory
from tests.portal.api.test_api import WRITE, api, create_body, post
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]

URL = "/projects/vision/members/"


def membership(people: Any, who: str) -> Membership:
    return Membership.objects.get(user=people[who], project=people["project"])


def ask(people: Any, catalog: Any, tier: str = "dedicated", **kw: Any) -> actions.SandboxRequest:
    return actions.SandboxRequest(
        project=people["project"], tier=catalog[tier], image=catalog["image"], isolation="container", **kw
    )


def test_a_manager_sets_a_members_limit_and_it_is_audited(people: Any) -> None:
    manager = client_for(people["owner"])
    mark = membership(people, "member")
    page = manager.post(URL, {"action": "limit", "membership": mark.pk, "max_gpus": "2"}, follow=True)
    assert "mark may now hold at most 2 GPUs in Vision." in page.content.decode()
    mark.refresh_from_db()
    assert mark.max_gpus == 2
    assert AuditEntry.objects.filter(target_type="accounts.membership", target_id=str(mark.pk)).exists()
    shown = manager.get("/projects/vision/").content.decode()
    assert 'aria-label="GPU limit of mark"' in shown and 'value="2"' in shown
    cleared = manager.post(URL, {"action": "limit", "membership": mark.pk, "max_gpus": ""}, follow=True)
    assert "mark may now hold no GPU limit of their own in Vision." in cleared.content.decode()
    for bad in ("two", "-1", "1001", "1e3"):
        refused = manager.post(URL, {"action": "limit", "membership": mark.pk, "max_gpus": bad}, follow=True)
        assert refused.status_code == 200 and "A member&#x27;s GPU limit is" in refused.content.decode()
    # A member is not a manager: they cannot raise their own limit.
    assert (
        client_for(people["member"]).post(URL, {"action": "limit", "membership": mark.pk}).status_code == 403
    )


def test_a_request_past_the_members_limit_is_refused_counting_held_and_waiting(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    Membership.objects.filter(pk=membership(people, "member").pk).update(max_gpus=2)
    mark = people["member"]
    request(mark, people["project"], catalog["dedicated"], catalog["image"], gpu_count=1)
    place_all()  # it holds one GPU now
    request(mark, people["project"], catalog["mig"], catalog["image"], mig_profile="3g.40gb")  # 3/7 waits
    with pytest.raises(actions.SandboxRequestError) as refused:
        actions.check_request_sandbox(mark, ask(people, catalog, gpu_count=1))
    assert refused.value.field == "project"
    assert refused.value.message == (
        "You may hold at most 2 GPUs in Vision (set by its managers): your sandboxes there hold or wait "
        "for 1.428 and this needs 1 more."
    )
    assert preview_request(mark, ask(people, catalog, gpu_count=1)).verdict == "refused"
    api_refusal = post(api(mark, [WRITE]), "/api/v1/sandboxes/", create_body(), key="k")
    assert api_refusal.status_code == 400 and "at most 2 GPUs in Vision" in api_refusal.json()["project"][0]
    # Within the limit, and for others in the project, requests go on.
    request(mark, people["project"], catalog["mig"], catalog["image"], mig_profile="1g.10gb")
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=2)
    cpu = TierFactory(slug="cpu")
    request(mark, people["project"], cpu, catalog["image"])  # a CPU-only sandbox holds no GPU
