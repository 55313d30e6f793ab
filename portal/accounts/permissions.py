"""API permissions: token scopes and the projects a caller reaches (rate limits:
``portal.api.throttles``).

A session (the browser) has the user's full rights; a token has the user's rights cut
down to its scopes: ``read:usage`` reads, ``write:sandboxes`` changes sandboxes,
``admin`` does everything and, only through it, a staff user's token reaches every project.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework import permissions
from rest_framework.request import Request

from portal.accounts.access import can_manage_sandbox, can_manage_sandbox_by_token, visible_projects
from portal.accounts.models import ApiToken, Membership, Project

Scope = ApiToken.Scope


def token_of(request: Request) -> ApiToken | None:
    return request.auth if isinstance(request.auth, ApiToken) else None


def has_scope(request: Request, scope: str) -> bool:
    token = token_of(request)
    return token is None or scope in token.scopes or Scope.ADMIN in token.scopes


def _staff_rights(request: Request) -> bool:
    """Staff reach every project by session, by token only with the admin scope."""
    return bool(request.user.is_staff) and has_scope(request, Scope.ADMIN)


def api_sees_all(request: Request) -> bool:
    """Staff with full rights: lists skip the project filter (a join that blocks index use)."""
    return bool(request.user.is_staff) and _staff_rights(request)


def api_projects(request: Request) -> QuerySet[Project]:
    """The projects this API caller may read (visible_projects, narrowed for tokens)."""
    if request.user.is_staff and not _staff_rights(request):
        return Project.objects.filter(memberships__user=request.user)
    return visible_projects(request.user)


def api_requestable_projects(request: Request) -> QuerySet[Project]:
    """Projects the caller may start sandboxes in: managers and members (not billing viewers)."""
    if _staff_rights(request):
        return Project.objects.all()
    return Project.objects.filter(
        memberships__user_id=int(request.user.pk or 0),
        memberships__role__in=[Membership.Role.MANAGER, Membership.Role.MEMBER],
    ).distinct()


def api_can_manage_sandbox(request: Request, sandbox: Any) -> bool:
    token = token_of(request)
    if token is None:
        return can_manage_sandbox(request.user, sandbox)
    return can_manage_sandbox_by_token(request.user, sandbox, token.scopes)


class TokenScopes(permissions.BasePermission):
    """Reads need ``read:usage``, writes ``write:sandboxes``; a view may name its own
    scopes in ``read_scope`` / ``write_scope``. Sessions pass (CSRF is checked by DRF)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not request.user.is_authenticated:
            return False  # DRF answers 401: the token authenticator names its header
        if request.method in permissions.SAFE_METHODS:
            scope = getattr(view, "read_scope", Scope.READ_USAGE)
        else:
            scope = getattr(view, "write_scope", Scope.WRITE_SANDBOXES)
        if has_scope(request, scope):
            return True
        self.message = f"This API token lacks the scope '{scope}'."
        return False
