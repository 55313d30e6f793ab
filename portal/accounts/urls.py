"""Signing in and out, passwords (Django's own views, the portal's templates in
``templates/registration/``), API tokens, SSH keys; the projects and SSH keys API."""

from django.contrib.auth import views as auth_views
from django.urls import path
from rest_framework.routers import SimpleRouter

from portal.accounts import ssh_key_views, token_views
from portal.accounts.api import ProjectViewSet, SshKeyViewSet
from portal.accounts.throttle import ThrottledLoginView, ThrottledPasswordResetView

api_router = SimpleRouter()
api_router.register("projects", ProjectViewSet, basename="project")
api_router.register("ssh-keys", SshKeyViewSet, basename="ssh-key")

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
    path("account/ssh-keys/", ssh_key_views.ssh_keys_page, name="ssh-keys"),
    path("account/ssh-keys/<int:pk>/remove/", ssh_key_views.ssh_key_remove, name="ssh-key-remove"),
]
