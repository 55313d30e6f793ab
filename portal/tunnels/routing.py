"""The terminal's socket, for a browser's session and for an API token (the command-line
client's shell) alike; ``portal/routing.py`` gathers every app's sockets."""

from django.urls import path

from portal.tunnels.consumers import SandboxTerminal

websocket_urlpatterns = [
    path("ws/sandboxes/<int:sandbox_id>/terminal/", SandboxTerminal.as_asgi()),
]
