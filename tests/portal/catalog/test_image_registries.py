"""Registries an admin approves (``ImageRegistry``): what a reference falls under, the
catalog's forms, the launch's ``pull`` flag, and the progress a starting sandbox's page
shows while its host pulls (the pull itself: tests/workers/test_image_pull.py)."""

from __future__ import annotations

from typing import Any

import pytest

from portal.audit.models import AuditEntry
from portal.catalog import registries
from portal.catalog.models import ImageRegistry, SandboxImage
from portal.control import tasks
from portal.control.reconcile import LAUNCH_RESEND_S, do_reconcile_host
from portal.sandboxes.models import Sandbox
from portal.sandboxes.specs import launch_spec
from tests.portal.control.test_reconcile import host_of, later, placed
from tests.portal.helpers import client_for

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]


@pytest.mark.parametrize(
    ("reference", "full"),
    [
        ("python:3.11", "docker.io/library/python:3.11"),
        ("pytorch/pytorch:2", "docker.io/pytorch/pytorch:2"),
        ("registry.lab.example/ml/torch:2", "registry.lab.example/ml/torch:2"),
        ("127.0.0.1:5000/lab/base:1", "127.0.0.1:5000/lab/base:1"),
        ("localhost/x:1", "localhost/x:1"),
    ],
)
def test_references_are_compared_in_dockers_full_form(reference: str, full: str) -> None:
    assert registries.full_reference(reference) == full


def test_a_prefix_approves_what_is_under_it_only() -> None:
    prefixes = [
        registries.checked_prefix("registry.lab.example/ml"),
        registries.checked_prefix("docker.io/pytorch/"),
    ]
    assert prefixes == ["registry.lab.example/ml/", "docker.io/pytorch/"]
    assert registries.approved_by("registry.lab.example/ml/torch:2", prefixes) == "registry.lab.example/ml/"
    assert registries.approved_by("pytorch/pytorch:2", prefixes) == "docker.io/pytorch/"
    assert (
        registries.approved_by("registry.lab.example/mlx/torch:2", prefixes) is None
    )  # not a namespace of it
    assert registries.approved_by("evil.example/ml/torch:2", prefixes) is None
    assert registries.approved_by("gpushare/sandbox-base:1", prefixes) is None


def test_the_console_approves_a_registry_and_refuses_a_bad_prefix(people: Any, catalog: Any) -> None:
    admin = client_for(people["admin"])
    bad = admin.post("/console/catalog/registries/new/", {"prefix": "ml/team", "note": "", "active": "on"})
    assert bad.status_code == 400 and "Start with the registry" in bad.content.decode()
    good = admin.post(
        "/console/catalog/registries/new/",
        {"prefix": "127.0.0.1:5000/lab", "note": "the lab's", "active": "on"},
    )
    assert good.status_code == 302
    assert list(ImageRegistry.objects.values_list("prefix", flat=True)) == ["127.0.0.1:5000/lab/"]
    assert AuditEntry.objects.filter(target_type="catalog.imageregistry", actor=people["admin"]).count() == 1
    # An image under it is accepted, and listed as pulled; one from another registry is refused.
    fields = {
        "name": "Torch",
        "reference": "127.0.0.1:5000/lab/torch:2",
        "command": '["sleep", "60"]',
        "active": "on",
    }
    assert admin.post("/console/catalog/images/new/", fields).status_code == 302
    other = admin.post(
        "/console/catalog/images/new/", {**fields, "name": "Other", "reference": "evil.example/x:1"}
    )
    assert other.status_code == 400 and "evil.example is not an approved registry" in other.content.decode()
    page = admin.get("/console/catalog/").content.decode()
    assert "127.0.0.1:5000/lab/" in page and "pulled when missing" in page
    owner = client_for(people["owner"])
    assert owner.get("/console/catalog/registries/new/").status_code == 302  # to the sign-in page


def test_a_launch_pulls_only_an_image_under_an_approved_registry(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog, running=False)
    assert launch_spec(sandbox).pull is False  # gpushare/sandbox-base: built on the hosts
    ImageRegistry.objects.create(prefix="127.0.0.1:5000/lab/")
    SandboxImage.objects.filter(pk=sandbox.image_id).update(reference="127.0.0.1:5000/lab/base:1")
    sandbox.refresh_from_db()
    assert launch_spec(sandbox).pull is True
    ImageRegistry.objects.update(active=False)
    assert launch_spec(sandbox).pull is False


def test_a_starting_sandbox_shows_its_pull_and_is_not_launched_again_meanwhile(
    people: Any, catalog: Any, fleet: Any, sent_tasks: Any
) -> None:
    sandbox = placed(people, catalog, running=False)
    line = "pulling 127.0.0.1:5000/lab/torch:2: 1 of 4 layers, 212.0 MiB of 2.0 GiB"
    tasks.launch_progress(sandbox.allocation_key, line)
    status = client_for(people["owner"]).get(f"/sandboxes/{sandbox.pk}/status/").content.decode()
    assert 'id="launch-progress"' in status and "Pulling 127.0.0.1:5000/lab/torch:2: 1 of 4 layers" in status
    # A host that reports progress is alive: its launch is not sent again until it goes quiet.
    Sandbox.objects.filter(pk=sandbox.pk).update(launch_progress_at=later(LAUNCH_RESEND_S))  # its next report
    assert not do_reconcile_host(host_of(sandbox), later(LAUNCH_RESEND_S + 1), []).launches_resent
    assert do_reconcile_host(host_of(sandbox), later(2 * LAUNCH_RESEND_S + 1), []).launches_resent
