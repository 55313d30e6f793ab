"""Every app's pages and API, gathered: each app lists its own routes in its ``urls.py``
(``urlpatterns`` for pages; ``api_router`` and ``api_urlpatterns`` for what it serves under
``/api/v1/``). URL names stay bare, without an app namespace: templates and tests reverse
them by name. Sockets are routed in ``portal/routing.py``."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from portal.accounts import urls as accounts
from portal.api.schema import SchemaView
from portal.billing import urls as billing
from portal.console import urls as console
from portal.identity import urls as identity
from portal.notifications import urls as notifications
from portal.projects import urls as projects
from portal.quotas import urls as quotas
from portal.sandboxes import urls as sandboxes
from portal.scheduling import urls as scheduling
from portal.telemetry import urls as telemetry
from portal.tunnels import urls as tunnels

# A busy database (pool exhausted, SQLite locked) anywhere in a request: 503, not 500.
handler500 = "portal.overload.server_error"

# One router, so that /api/v1/ lists every app's endpoints.
router = DefaultRouter()
for app_router in (billing.api_router, sandboxes.api_router, accounts.api_router, quotas.api_router):
    for prefix, viewset, basename in app_router.registry:
        router.register(prefix, viewset, basename=basename)

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="sandbox-list", permanent=False)),
    *(
        path("", include(app.urlpatterns))
        for app in (
            telemetry,
            accounts,
            identity,
            sandboxes,
            scheduling,
            notifications,
            tunnels,
            projects,
            billing,
            console,
        )
    ),
    path("admin/", admin.site.urls),
    path("api/v1/", include(billing.api_urlpatterns)),
    path("api/v1/", include(telemetry.api_urlpatterns)),
    path("api/v1/", include(([*scheduling.api_urlpatterns, *router.urls], "api"), namespace="api")),
    path("api/schema/", SchemaView.as_view(), name="api-schema"),
    # The split view serves Swagger UI's start-up script as a file: no inline script for CSP.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
]
