"""The resume contract: each launch of a sandbox is an attempt; one queued again runs again
told its attempt number, why the last ended and where its checkpoints are (the same folder
on every attempt), and its history shows every attempt with its output."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.catalog.models import Storage
from portal.sandboxes import actions, output, preemption
from portal.sandboxes.models import Attempt, Sandbox
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import client_for
from tests.portal.sandboxes.test_graceful_preemption import (
    assert_starts,
    deadline,
    preempt_one,
    report_stopped,
)
from wire.spec import SandboxSpec

RESUME_VARIABLES = (
    "GPUSHARE_ATTEMPT", "GPUSHARE_RESUMED", "GPUSHARE_LAST_END", "GPUSHARE_LAST_END_MESSAGE",
    "GPUSHARE_CHECKPOINT_DIR",
)  # fmt: skip
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture
def batch(catalog: Any) -> Any:
    """Preemptible batch work that is queued again when preempted, with a project folder."""
    tier: Any = TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
        preempt_after=timedelta(minutes=10),
        preempt_grace=timedelta(seconds=90),
        requeue_on_preemption=True,
    )
    tier.storages.set(
        [
            Storage.objects.create(name="home", kind="home", directory="homes", mount_path="/home/sandbox"),
            Storage.objects.create(name="work", kind="project", directory="projects", mount_path="/work"),
        ]
    )
    return tier


def launches_of(sent_tasks: Any, sandbox: Sandbox) -> list[SandboxSpec]:
    specs = [SandboxSpec.from_json(a[0]) for _, t, a in sent_tasks if t == "launch_sandbox"]
    return [s for s in specs if s.sandbox_id == sandbox.pk]


def preempted_and_requeued(people: Any, catalog: Any, batch: Any) -> tuple[Sandbox, Sandbox]:
    urgent, victim = preempt_one(people, catalog, batch)
    preemption.do_stop_warned(deadline(victim))
    victim.refresh_from_db()
    return urgent, report_stopped(victim, "stopped by its host")


def test_the_first_launch_is_attempt_one_with_its_checkpoint_folder(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    _, victim = preempt_one(people, catalog, batch)
    [spec] = launches_of(sent_tasks, victim)
    folder = f"/work/.gpushare/checkpoints/sandbox-{victim.pk}"  # the project's storage, not the home
    assert spec.checkpoint_dir == folder
    told = {k: v for k, v in spec.env.items() if k in RESUME_VARIABLES}
    assert told == {"GPUSHARE_ATTEMPT": "1", "GPUSHARE_RESUMED": "0", "GPUSHARE_CHECKPOINT_DIR": folder}
    [attempt] = victim.attempts.all()
    assert (attempt.number, attempt.allocation_key, attempt.end) == (1, spec.allocation_key, "")


def test_a_requeued_victim_resumes_as_attempt_two_told_why(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    urgent, victim = preempted_and_requeued(people, catalog, batch)
    assert victim.state == "queued" and victim.attempt == 1
    first = Attempt.objects.get(sandbox=victim, number=1)
    assert first.end == "preempted" and first.ended_at is not None
    assert f"preempted for sandbox {urgent.pk}" in first.end_message

    actions.do_mark_running(urgent.allocation_key, {"driver": "docker", "ref": "u"}, timezone.now())
    actions.do_request_stop(urgent.pk, people["outsider"])
    urgent.refresh_from_db()
    report_stopped(urgent)
    assert_starts(victim)
    before, again = launches_of(sent_tasks, victim)
    assert again.checkpoint_dir == before.checkpoint_dir  # the same folder, whichever host
    assert again.env["GPUSHARE_ATTEMPT"] == "2" and again.env["GPUSHARE_RESUMED"] == "1"
    assert again.env["GPUSHARE_LAST_END"] == "preempted"
    assert f"preempted for sandbox {urgent.pk}" in again.env["GPUSHARE_LAST_END_MESSAGE"]
    victim.refresh_from_db()
    assert victim.attempt == 2 and [a.number for a in victim.attempts.all()] == [1, 2]


def test_a_host_lost_under_a_tier_that_requeues_is_told_lost(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    batch.requeue_on_failure = True
    batch.save()
    _, victim = preempt_one(people, catalog, batch)  # placed and warned: a warned victim ends as preempted
    victim.preempt_at, victim.stop_cause, victim.preempted_for = None, "", None
    victim.save()
    assert actions.do_lose(victim.pk, "host h100 stopped answering") == "queued"
    victim.refresh_from_db()
    assert Attempt.objects.get(sandbox=victim, number=1).end == "lost"
    lost = Sandbox.objects.get(pk=victim.pk)
    lost.attempt += 1  # as the next booking counts it
    env = launch_spec_env(lost)
    assert (
        env["GPUSHARE_LAST_END"] == "lost"
        and "host h100 stopped answering" in env["GPUSHARE_LAST_END_MESSAGE"]
    )


def launch_spec_env(sandbox: Sandbox) -> dict[str, str]:
    from portal.sandboxes import resume

    return resume.resume_env(sandbox, "")


def test_each_attempts_output_is_kept_and_read_apart(
    people: Any, catalog: Any, batch: Any, fleet: Any, sent_tasks: Any
) -> None:
    _, victim = preempt_one(people, catalog, batch)
    first_key = victim.allocation_key
    output.do_store_output(first_key, 0, b"step 1\nstep 2\n", 14)
    preemption.do_stop_warned(deadline(victim))
    victim = report_stopped(Sandbox.objects.get(pk=victim.pk))
    # Its last words, flushed as it was stopped, come after the requeue: kept as attempt 1's.
    assert output.do_store_output(first_key, 14, b"step 3\n", 21) == 7
    victim.attempt, victim.allocation_key = 2, "k2"
    victim.save()
    Attempt.objects.create(sandbox=victim, number=2, allocation_key="k2", host_name="a100")
    output.do_store_output("k2", 0, b"resumed from step 3\n", 20)

    api = client_for(people["owner"])
    url = f"/api/v1/sandboxes/{victim.pk}"
    attempts = api.get(f"{url}/attempts/").json()
    assert [(a["number"], a["end"], a["current"]) for a in attempts] == [
        (1, "preempted", False),
        (2, "", True),
    ]
    assert api.get(f"{url}/output/").json()["text"] == "resumed from step 3\n"
    assert api.get(f"{url}/output/", {"attempt": 1}).json()["text"] == "step 1\nstep 2\nstep 3\n"
    refused = api.get(f"{url}/output/", {"attempt": 3})
    assert refused.status_code == 400 and refused.json()["attempt"] == [
        "An attempt this sandbox made: 1 to 2."
    ]
    assert client_for(people["outsider"]).get(f"{url}/attempts/").status_code == 404
