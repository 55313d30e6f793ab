"""Every app's sockets, gathered for ``portal/asgi.py`` (pages and API: ``portal/urls.py``)."""

from django.urls import re_path

from portal.accounts.socket_auth import NotForTokens
from portal.telemetry import routing as telemetry
from portal.tunnels import routing as tunnels

websocket_urlpatterns = [*telemetry.websocket_urlpatterns, *tunnels.websocket_urlpatterns]

# Sockets opened with an API token (portal/accounts/socket_auth.py): the terminal and SSH
# only. The samples' consumers filter by the user's projects, not by a token's narrower reach.
token_websocket_urlpatterns = [
    *tunnels.websocket_urlpatterns,
    re_path(r"", NotForTokens()),  # type: ignore[arg-type]  # an ASGI app, as Channels routes
]
