"""An image from an approved registry, end to end with real processes: the admin's approval,
the request, the agent pulling the image it lacks from a real registry on loopback and
reporting progress through the control worker, the sandbox running from it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from portal.catalog.models import ImageRegistry, SandboxImage
from portal.sandboxes.models import Sandbox
from tests.e2e.platform import running_platform, wait_for
from tests.e2e.test_loop import ask
from tests.workers.test_image_pull import client, published, registry  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_sandbox_from_an_approved_registry_is_pulled_with_progress_then_runs(
    people: Any,
    catalog: Any,
    tmp_path: Path,
    registry: str,  # noqa: F811 - a fixture
    published: str,  # noqa: F811 - a fixture
) -> None:
    ImageRegistry.objects.create(prefix=f"{registry}/lab/", note="the lab's registry")
    image = SandboxImage.objects.create(name="From the lab", reference=published, command=["sleep", "300"])
    web = Client()
    web.force_login(people["owner"])
    with running_platform(tmp_path) as platform:
        pk = ask(
            web,
            {
                "project": str(people["project"].pk), "tier": str(catalog["dedicated"].pk), "gpu_count": "1",
                "image": str(image.pk), "isolation": "container", "duration_hours": "1",
            },
        )  # fmt: skip
        wait_for(lambda: Sandbox.objects.get(pk=pk).state in ("running", "failed"), 120, "the sandbox to run")
        sandbox = Sandbox.objects.get(pk=pk)
        assert sandbox.state == "running", (sandbox.failure, platform.logs()[-3000:])
    # What the agent reported while it started (its last line may land once it runs, and is
    # then not kept: the page shows it only while the sandbox starts).
    line = sandbox.launch_progress
    assert re.fullmatch(rf"pulling {re.escape(published)}: \d+ of [1-9]\d* layers.*", line), line
