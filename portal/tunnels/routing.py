"""The terminal's and SSH's sockets, for a browser's session and for an API token (the
command-line client's shell and ssh-proxy) alike; ``portal/routing.py`` gathers every app's
sockets."""

from django.urls import path

from portal.tunnels.consumers import SandboxTerminal
from portal.tunnels.ssh import SandboxSsh

websocket_urlpatterns = [
    path("ws/sandboxes/<int:sandbox_id>/terminal/", SandboxTerminal.as_asgi()),
    path("ws/sandboxes/<int:sandbox_id>/ssh/", SandboxSsh.as_asgi()),
]
