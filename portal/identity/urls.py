"""Single sign-on through OpenID Connect (404 until OIDC_RP_CLIENT_ID is set)."""

from django.urls import path

from portal.identity import views

urlpatterns = [
    path("oidc/authenticate/", views.oidc_start, name="oidc_authentication_init"),
    path("oidc/callback/", views.oidc_callback, name="oidc_authentication_callback"),
]
