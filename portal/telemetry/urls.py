"""Health and metrics, the GPU pages and heatmap (under /console/), the history series the
charts read, alerts, and the utilization API."""

from django.urls import path

from portal.telemetry import pages, views
from portal.telemetry.api import UtilizationView
from portal.telemetry.health import healthz
from portal.telemetry.metrics import metrics

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("console/gpus/<str:uuid>/", pages.gpu_page, name="console-gpu"),
    path("console/heatmap/", pages.heatmap, name="console-heatmap"),
    path("telemetry/gpus/<str:uuid>/history/", views.gpu_history, name="telemetry-gpu-history"),
    path(
        "telemetry/sandboxes/<int:pk>/history/",
        views.sandbox_history,
        name="telemetry-sandbox-history",
    ),
    path("telemetry/fleet/history/", views.fleet_history, name="telemetry-fleet-history"),
    path("telemetry/alerts/", views.alerts, name="telemetry-alerts"),
]

# Under /api/v1/ outside the ``api`` namespace.
api_urlpatterns = [
    path("utilization/", UtilizationView.as_view(), name="api-utilization"),
]
