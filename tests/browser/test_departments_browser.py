"""A department in Chromium, against the real platform (web server, control worker, an agent
with four simulated H100s): a member sees the department above their project, what all of its
projects hold and whether they borrow; the console lists the tree; and the sibling project
takes back what was borrowed, the borrower warned with its tier's grace and then stopped.
Screenshots: docs/screenshots/department.png, docs/screenshots/console-departments.png."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from portal.quotas.models import Department, QuotaPolicy
from portal.sandboxes.models import Sandbox
from tests.browser.pages import shot, sign_in
from tests.e2e.platform import running_platform
from tests.portal.helpers import request

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_member_sees_the_department_and_an_admin_the_tree(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any
) -> None:
    page = browser_page
    catalog["dedicated"].preempt_grace = timedelta(seconds=3)
    catalog["dedicated"].save()
    science = Department.objects.create(name="Science", guaranteed_gpus=Decimal(4), max_gpus=6)
    physics = Department.objects.create(name="Physics", parent=science, max_gpus=4)
    for project in (people["project"], people["other_project"]):
        QuotaPolicy.objects.create(
            project=project, department=physics, guaranteed_gpus=Decimal(1), max_gpus=4
        )
    with running_platform(tmp_path, web=True, sim_gpus="H100-80GB:4", driver="simulated") as p:
        base = f"http://127.0.0.1:{p.port}"
        # Vision runs four, the department's limit: one within its guarantee, three borrowed.
        mine = [
            request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
            for _ in range(4)
        ]
        wait_for(lambda: Sandbox.objects.filter(pk__in=[s.pk for s in mine], state="running").count() == 4)
        assert Sandbox.objects.filter(pk__in=[s.pk for s in mine], borrowed=True).count() == 3

        sign_in(page, base, "olivia", "/projects/vision/")
        department = page.locator("#department")
        department.wait_for()
        text = page.locator("main").inner_text()
        assert "Science / Physics" in text
        assert (
            "Physics (2 projects): 4 GPUs held of its 4 limit · guaranteed 2 · borrowing: may be reclaimed"
            in text
        )
        assert "Science (2 projects): 4 GPUs held of its 6 limit · guaranteed 4" in text
        shot(page, "department")

        page.context.clear_cookies()
        sign_in(page, base, "ada", "/console/catalog/")
        rows = page.locator("#departments tbody tr").all_inner_texts()
        assert any(r.startswith("Physics\tScience") for r in rows), rows
        page.locator("#departments").scroll_into_view_if_needed()
        shot(page, "console-departments")

        # NLP asks for its guaranteed GPU: physics is at its limit, so one of vision's borrowed
        # sandboxes is warned, stopped 3 s later, and NLP's runs on its GPU.
        theirs = request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
        wait_for(lambda: Sandbox.objects.get(pk=theirs.pk).state == "running")
        [victim] = Sandbox.objects.filter(pk__in=[s.pk for s in mine], state="preempted")
        assert victim.borrowed
        said = list(victim.events.values_list("message", flat=True))
        warned = next(m for m in said if m.startswith("preemption warning"))
        assert "reclaimed: project vision borrowed this capacity over its guarantee" in warned, said
        assert Sandbox.objects.filter(pk__in=[s.pk for s in mine], state="running").count() == 3


def wait_for(done: Callable[[], bool], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, list(Sandbox.objects.values_list("pk", "state", "pending_reason"))
        time.sleep(0.5)
