from __future__ import annotations

import time
from typing import Any

from django.test import Client

from portal.control.scheduling import schedule_once
from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox


def request(
    user: Any, project: Any, tier: Any, image: Any, isolation: str = "container", **kw: Any
) -> Sandbox:
    req = actions.SandboxRequest(project=project, tier=tier, image=image, isolation=isolation, **kw)
    actions.check_request_sandbox(user, req)
    return actions.do_request_sandbox(user, req)


def place_all() -> None:
    schedule_once(now=time.time())  # as the control worker calls it


def client_for(user: Any) -> Client:
    c = Client()
    c.force_login(user)
    return c


def request_form(people: Any, catalog: Any, **fields: str) -> dict[str, str]:
    """The request form's fields for one dedicated GPU in the owner's project."""
    return {
        "project": str(people["project"].pk),
        "tier": str(catalog["dedicated"].pk),
        "image": str(catalog["image"].pk),
        "isolation": "container",
        "gpu_count": "1",
        "duration_hours": "1",
        **fields,
    }
