"""The OpenID Connect sign-in's two pages (mozilla-django-oidc's views), answering 404 while
no provider is configured rather than failing on the settings it lacks."""

from __future__ import annotations

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView


def _configured() -> None:
    if not settings.OIDC_ENABLED:
        raise Http404("Single sign-on is not configured")


def oidc_start(request: HttpRequest) -> HttpResponse:
    _configured()
    return OIDCAuthenticationRequestView.as_view()(request)


def oidc_callback(request: HttpRequest) -> HttpResponse:
    _configured()
    return OIDCAuthenticationCallbackView.as_view()(request)
