"""The request form's live answer: the page's (htmx) and the API's."""

from django.urls import path, re_path

from portal.scheduling import views
from portal.scheduling.api import SandboxPreviewView

urlpatterns = [
    path("sandboxes/preview/", views.sandbox_preview, name="sandbox-preview"),
]

# Under /api/v1/ in the ``api`` namespace, before the sandboxes' router (see api.py), with
# the format suffix its router gave it (``preview.json``).
api_urlpatterns = [
    re_path(r"^sandboxes/preview/$", SandboxPreviewView.as_view(), name="sandbox-request-preview"),
    re_path(
        r"^sandboxes/preview\.(?P<format>[a-z0-9]+)/?$",
        SandboxPreviewView.as_view(),
        name="sandbox-request-preview",
    ),
]
