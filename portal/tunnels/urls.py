"""The owner's way onto a sandbox's web app (the terminal is a socket: ``routing.py``)."""

from django.urls import path

from portal.tunnels import views

urlpatterns = [
    path("sandboxes/<int:pk>/app/", views.open_app, name="sandbox-app"),
    path("sandboxes/<int:pk>/app/<path:path>", views.open_app),
]
