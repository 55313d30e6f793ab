"""Signing in and out, passwords (Django's own views, the portal's templates in
``templates/registration/``), API tokens; the projects API."""

from django.contrib.auth import views as auth_views
from django.urls import path
from rest_framework.routers import SimpleRouter

from portal.accounts import token_views
from portal.accounts.api import ProjectViewSet
from portal.accounts.throttle import ThrottledLoginView, ThrottledPasswordResetView

api_router = SimpleRouter()
api_router.register("projects", ProjectViewSet, basename="project")

urlpatterns = [
    path("login/", ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("account/password/", auth_views.PasswordChangeView.as_view(), name="password_change"),
    path("account/password/done/", auth_views.PasswordChangeDoneView.as_view(), name="password_change_done"),
    path("password-reset/", ThrottledPasswordResetView.as_view(), name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path(
        "password-reset/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(),
        name="password_reset_confirm",
    ),
    path(
        "password-reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"
    ),
    path("account/tokens/", token_views.api_tokens, name="api-tokens"),
    path("account/tokens/<int:pk>/revoke/", token_views.api_token_revoke, name="api-token-revoke"),
]
