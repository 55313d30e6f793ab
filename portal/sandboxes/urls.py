"""Sandbox pages (list, request form, detail and its parts, output), the in-app
notifications page, and the sandboxes API."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from portal.sandboxes import views
from portal.sandboxes.api import SandboxViewSet

api_router = SimpleRouter()
api_router.register("sandboxes", SandboxViewSet, basename="sandbox")

urlpatterns = [
    path("sandboxes/", views.sandbox_list, name="sandbox-list"),
    path("sandboxes/new/", views.sandbox_new, name="sandbox-new"),
    path("notifications/", views.notifications, name="notifications"),
    path("sandboxes/<int:pk>/", views.sandbox_detail, name="sandbox-detail"),
    path("sandboxes/<int:pk>/status/", views.sandbox_status, name="sandbox-status"),
    path("sandboxes/<int:pk>/stop/", views.sandbox_stop, name="sandbox-stop"),
    path("sandboxes/<int:pk>/extend/", views.sandbox_extend, name="sandbox-extend"),
    path("sandboxes/<int:pk>/output.txt", views.sandbox_output_download, name="sandbox-output"),
]
