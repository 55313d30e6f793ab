"""What a running sandbox offers to be reached by: a terminal (containers and processes), and
its image's web app on an origin of its own with a token of its own.

Facts about the sandbox, kept here so that its pages and its launch spec need nothing from
``portal/tunnels``, which does the reaching (the relay, the grants, the app's origin) and
sits above this app.
"""

from __future__ import annotations

from django.conf import settings
from django.utils.crypto import salted_hmac

from portal.sandboxes.models import Sandbox

TERMINAL_ISOLATION = ("container", "process")  # a VM's console is its serial line, not a pty exec


def app_origin(sandbox: Sandbox) -> str | None:
    """The origin its app is served on, or None when the portal serves no apps (no
    ``APPS_DOMAIN``, parsed by the settings into ``portal.tunnels.app_origin.AppsDomain``)."""
    apps = settings.APPS
    return apps.origin(sandbox.pk, sandbox.allocation_key) if apps is not None else None


def app_token(allocation_key: str) -> str:
    """The app's own secret (``GPUSHARE_APP_TOKEN`` in the sandbox): the proxy sends it with
    each request it lets through, so an app that asks for it (JupyterLab's token) answers
    only what came through the owner's app session, never a bare connection to its socket.
    The salt keeps the module path it was first written under: a new salt would change the
    token of every app already running."""
    return salted_hmac("portal.sandboxes.app_access.token", allocation_key, algorithm="sha256").hexdigest()
