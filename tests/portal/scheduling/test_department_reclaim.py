"""A department shares its guarantee between its projects, end to end through the portal's
cycle: one project borrows its sibling's idle guarantee, and gives it back, warned with its
tier's grace and then stopped, when the sibling asks; the project page shows the department."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from portal.audit.models import AuditEntry
from portal.quotas.models import Department, QuotaPolicy
from portal.sandboxes import actions, preemption
from portal.sandboxes.models import Notification, Sandbox
from portal.scheduling.snapshot import build_fairshare
from tests.portal.helpers import client_for, place_all, request
from tests.portal.sandboxes.test_graceful_preemption import assert_starts, deadline, report_stopped

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
GRACE = timedelta(seconds=90)


@pytest.fixture
def physics(people: Any, catalog: Any) -> Department:
    """Department physics over vision and the other project, each guaranteed 2 of the
    fleet's 4 dedicated GPUs, each allowed all 4."""
    department = Department.objects.create(name="Physics", max_gpus=4)
    for project in (people["project"], people["other_project"]):
        QuotaPolicy.objects.create(
            project=project, department=department, guaranteed_gpus=Decimal(2), max_gpus=4
        )
    catalog["dedicated"].preempt_grace = GRACE
    catalog["dedicated"].save()
    return department


def test_a_project_borrows_its_siblings_guarantee_and_gives_it_back_with_its_tiers_grace(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any, physics: Department
) -> None:
    state = build_fairshare(timezone.now().timestamp())
    assert state.projects["vision"].department == "Physics" and "Physics" in state.departments

    # Vision alone: all four GPUs, two within its guarantee and two borrowed from its sibling.
    mine = [
        request(people["owner"], people["project"], catalog["dedicated"], catalog["image"]) for _ in range(4)
    ]
    place_all()
    started = timezone.now() - timedelta(hours=1)
    for sandbox in mine:
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, started)
    assert sorted(Sandbox.objects.get(pk=s.pk).borrowed for s in mine) == [False, False, True, True]
    page = client_for(people["owner"]).get("/projects/vision/").content.decode()
    assert 'id="department"' in page and "Physics (2 projects): 4 GPUs held of its 4 limit" in page
    assert "borrowing: may be reclaimed" not in page  # the department is within its guarantee

    # The sibling asks for its two: the two borrowed sandboxes are warned, with the tier's grace.
    theirs = [
        request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
        for _ in range(2)
    ]
    place_all()
    victims = list(Sandbox.objects.filter(preempted_for__isnull=False))
    assert sorted(v.pk for v in victims) == sorted(
        s.pk for s in mine if Sandbox.objects.get(pk=s.pk).borrowed
    )
    for victim in victims:
        assert victim.state == "running" and victim.preempt_at is not None
        assert victim.preempt_at >= timezone.now() + GRACE - timedelta(seconds=5)
        told = Notification.objects.filter(user=people["owner"], sandbox=victim).first()
        assert told is not None and told.kind == "preempted"
        assert "gives back capacity its project borrowed over its guarantee" in told.message
        warning = str(victim.events.values_list("message", flat=True).last())
        assert (
            "(reclaimed: project vision borrowed this capacity over its guarantee and project nlp" in warning
        )
    for request_ in theirs:
        request_.refresh_from_db()
        assert request_.state == "queued"

    # The grace runs out: the victims stop, and the sibling's requests start on their GPUs.
    preemption.do_stop_warned(max(deadline(v) for v in victims))
    for victim in victims:
        victim.refresh_from_db()
        assert report_stopped(victim).state == "preempted"
    for request_ in theirs:
        assert_starts(request_)
    # Vision keeps its guarantee: its two other sandboxes were never touched.
    assert Sandbox.objects.filter(project=people["project"], state="running").count() == 2


def test_the_console_builds_the_tree_refusing_loops_and_guarantees_that_do_not_nest(
    people: Any, catalog: Any, physics: Department
) -> None:
    admin = client_for(people["admin"])
    made = admin.post(
        "/console/catalog/departments/new/", {"name": "Science", "guaranteed_gpus": "6", "weight": "1"}
    )
    assert made.status_code == 302, made.content.decode()[:2000]
    science = Department.objects.get(name="Science")
    moved = admin.post(
        f"/console/catalog/departments/{physics.pk}/",
        {"name": "Physics", "parent": science.pk, "guaranteed_gpus": "4", "max_gpus": "4", "weight": "2"},
    )
    assert moved.status_code == 302, moved.content.decode()[:2000]
    physics.refresh_from_db()
    assert physics.parent == science and physics.path_text == "Science / Physics"
    assert AuditEntry.objects.filter(target_type="quotas.department").count() == 2

    loop = admin.post(
        f"/console/catalog/departments/{science.pk}/",
        {"name": "Science", "parent": physics.pk, "weight": "1"},
    )
    assert loop.status_code == 400 and "that would make a loop" in loop.content.decode()
    too_much = admin.post(
        f"/console/catalog/departments/{physics.pk}/",
        {"name": "Physics", "parent": science.pk, "guaranteed_gpus": "8", "weight": "1"},
    )
    assert too_much.status_code == 400
    assert "Science guarantees 6 GPUs in all, and its other parts 0 already: at most 6 here." in (
        too_much.content.decode()
    )
    too_little = admin.post(
        f"/console/catalog/departments/{physics.pk}/",
        {"name": "Physics", "parent": science.pk, "guaranteed_gpus": "3", "weight": "1"},
    )
    assert "Its parts guarantee 4 GPUs together" in too_little.content.decode()
    vision = QuotaPolicy.objects.get(project=people["project"])
    greedy = admin.post(
        f"/console/catalog/quotas/{vision.pk}/",
        {"project": people["project"].pk, "department": physics.pk, "guaranteed_gpus": "3", "max_gpus": "4",
         "max_live_sandboxes": "10", "weight": "1"},
    )  # fmt: skip
    assert greedy.status_code == 400
    assert "Physics guarantees 4 GPUs in all, and its other parts 2 already: at most 2 here." in (
        greedy.content.decode()
    )
    bad = admin.post(
        "/console/catalog/departments/new/", {"name": "", "guaranteed_gpus": "lots", "weight": "0"}
    )
    assert bad.status_code == 400 and "Enter a number." in bad.content.decode()

    page = admin.get("/console/catalog/").content.decode()
    assert 'id="departments"' in page and "Science" in page and "its parts&#x27;" not in page
    # A limit per model is a project's or a department's, never both nor neither.
    both = admin.post(
        "/console/catalog/model-quotas/new/",
        {
            "quota": QuotaPolicy.objects.get(project=people["project"]).pk,
            "department": physics.pk,
            "name": "H100-80GB",
            "max_gpus": "1",
        },
    )
    assert both.status_code == 400 and "one of the two" in both.content.decode()
    mine = admin.post(
        "/console/catalog/model-quotas/new/", {"department": physics.pk, "name": "H100-80GB", "max_gpus": "1"}
    )
    assert mine.status_code == 302
    assert client_for(people["owner"]).get("/console/catalog/departments/new/").status_code == 302

    # Members see it through the API too.
    quotas = client_for(people["owner"]).get("/api/v1/quotas/").json()["results"]
    assert [q["department"] for q in quotas] == ["Science / Physics"]
