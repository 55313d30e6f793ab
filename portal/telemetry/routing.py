from django.urls import path, re_path

from portal.accounts.socket_auth import NotForTokens
from portal.sandboxes.consumers import SandboxTerminal
from portal.telemetry import consumers

websocket_urlpatterns = [
    path("ws/gpus/<str:uuid>/", consumers.GpuSamples.as_asgi()),
    path("ws/sandboxes/<int:sandbox_id>/", consumers.SandboxSamples.as_asgi()),
    path("ws/sandboxes/<int:sandbox_id>/terminal/", SandboxTerminal.as_asgi()),
    path("ws/fleet/", consumers.FleetSamples.as_asgi()),
]

# Sockets opened with an API token (portal/accounts/socket_auth.py): the terminal only. The
# samples' consumers filter by the user's projects, not by a token's narrower reach.
token_websocket_urlpatterns = [
    path("ws/sandboxes/<int:sandbox_id>/terminal/", SandboxTerminal.as_asgi()),
    re_path(r"", NotForTokens()),  # type: ignore[arg-type]  # an ASGI app, as Channels routes
]
