"""Every route of the portal the client calls, and the fields of a sandbox request, in one
place: tests/cli/test_schema_agreement.py checks each (method, path) against the portal's
OpenAPI schema (``/api/schema/``) and ``REQUEST_FIELDS`` against its ``SandboxCreateRequest``
component, so the client cannot drift from the API it speaks to without a test failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote


@dataclass(frozen=True)
class Route:
    """One operation of the OpenAPI schema: its method and its path template, as the schema
    spells it (``{id}`` for a path parameter)."""

    method: Literal["GET", "POST"]
    path: str

    def format(self, **params: int | str) -> str:
        return self.path.format(**{name: quote(str(value), safe="") for name, value in params.items()})


PROJECTS = Route("GET", "/api/v1/projects/")
SANDBOXES = Route("GET", "/api/v1/sandboxes/")
SANDBOX = Route("GET", "/api/v1/sandboxes/{id}/")
REQUEST = Route("POST", "/api/v1/sandboxes/")
PREVIEW = Route("POST", "/api/v1/sandboxes/preview/")
EVENTS = Route("GET", "/api/v1/sandboxes/{id}/events/")
OUTPUT = Route("GET", "/api/v1/sandboxes/{id}/output/")
ATTEMPTS = Route("GET", "/api/v1/sandboxes/{id}/attempts/")
EXTEND = Route("POST", "/api/v1/sandboxes/{id}/extend/")
STOP = Route("POST", "/api/v1/sandboxes/{id}/stop/")
USAGE = Route("GET", "/api/v1/usage/")
INVOICES = Route("GET", "/api/v1/invoices/")
INVOICE = Route("GET", "/api/v1/invoices/{id}/")
SSH_KEYS = Route("GET", "/api/v1/ssh-keys/")
ADD_SSH_KEY = Route("POST", "/api/v1/ssh-keys/")

ROUTES: tuple[Route, ...] = (
    PROJECTS, SANDBOXES, SANDBOX, REQUEST, PREVIEW, EVENTS, OUTPUT, ATTEMPTS, EXTEND, STOP, USAGE, INVOICES,
    INVOICE, SSH_KEYS, ADD_SSH_KEY,
)  # fmt: skip

# The component of the schema whose fields REQUEST_FIELDS mirror (the body of REQUEST and PREVIEW).
REQUEST_COMPONENT = "SandboxCreateRequest"

# Not in the OpenAPI schema (it describes HTTP only): the sandbox terminal's and SSH's
# WebSockets, which take the same API token (portal/accounts/socket_auth.py).
TERMINAL_SOCKET = "/ws/sandboxes/{id}/terminal/"
SSH_SOCKET = "/ws/sandboxes/{id}/ssh/"


@dataclass(frozen=True)
class RequestField:
    """A field of the sandbox request body and the ``gpushare request`` option that sets it."""

    name: str  # the API's field name
    kind: type[int] | type[str]
    option: str
    help: str
    required: bool = False
    metavar: str | None = None


REQUEST_FIELDS: tuple[RequestField, ...] = (
    RequestField("project", str, "--project", "project slug (gpushare login lists yours)", True, "SLUG"),
    RequestField("tier", str, "--tier", "tier slug: its sharing mode, price and limits", True, "SLUG"),
    RequestField("image", str, "--image", "sandbox image name, e.g. busybox", True, "NAME"),
    RequestField("isolation", str, "--isolation", "container (default), process or vm", metavar="LEVEL"),
    RequestField(
        "gpu_count", int, "--gpus", "dedicated tiers: whole GPUs, 1 to the tier's maximum", metavar="N"
    ),
    RequestField(
        "nodes",
        int,
        "--nodes",
        "dedicated tiers on a Slurm cluster: one job over N nodes, --gpus on each",
        metavar="N",
    ),
    RequestField(
        "gpu_model",
        str,
        "--gpu-model",
        "GPU tiers: the model, one the tier offers (/api/v1/prices/ lists them), e.g. H100-80GB; default any",
        metavar="MODEL",
    ),
    RequestField(
        "mig_profile", str, "--mig-profile", "MIG tiers: the profile, e.g. 1g.10gb", metavar="PROFILE"
    ),
    RequestField(
        "mps_memory_gib", int, "--mps-memory", "MPS tiers: memory share in GiB (1-80)", metavar="GIB"
    ),
    RequestField(
        "mps_thread_pct", int, "--mps-threads", "MPS tiers: thread share in %% (1-100)", metavar="PCT"
    ),
    RequestField("duration_hours", int, "--hours", "time limit in hours (default 1)", metavar="N"),
    RequestField(
        "run", str, "--run", "interactive (default) or batch; --command implies batch", metavar="KIND"
    ),
    RequestField("command", str, "--command", "batch runs: the command, split like a shell", metavar="CMD"),
    RequestField("name", str, "--name", "a label for your lists", metavar="TEXT"),
)
