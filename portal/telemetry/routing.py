"""The live samples' sockets (session only; ``portal/routing.py`` gathers every app's)."""

from django.urls import path

from portal.telemetry import consumers

websocket_urlpatterns = [
    path("ws/gpus/<str:uuid>/", consumers.GpuSamples.as_asgi()),
    path("ws/sandboxes/<int:sandbox_id>/", consumers.SandboxSamples.as_asgi()),
    path("ws/fleet/", consumers.FleetSamples.as_asgi()),
]
