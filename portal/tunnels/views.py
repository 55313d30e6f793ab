"""The portal's side of a sandbox's web app: the signed-in owner's way onto the app's own
origin (``app_access``); the app itself is served by ``app_proxy`` on that origin."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from portal.sandboxes.views import get_sandbox_for_user
from portal.tunnels import app_access


@login_required
def open_app(request: HttpRequest, pk: int, path: str = "") -> HttpResponse:
    """*Open JupyterLab*: the owner's browser goes to the app's own origin with a grant
    (``app_access``); ``path`` and the query go along, so an old link to
    ``/sandboxes/<id>/app/lab`` still lands on the app's ``/lab``."""
    sandbox = get_sandbox_for_user(request, pk)  # 404 for one the user may not see: no hint it exists
    verdict = app_access.owner_verdict(request.user, sandbox)
    if isinstance(verdict, app_access.Refusal):
        context = {"reason": verdict.reason, "pk": pk}
        return render(request, "sandboxes/app_refused.html", context, status=verdict.status)
    if request.session.session_key is None:  # signed in, so saved; kept for the type checker
        request.session.save()
    query = request.META.get("QUERY_STRING", "")
    target = f"/{path}" + (f"?{query}" if query else "")
    grant = app_access.issue_grant(request.user, str(request.session.session_key), verdict, pk, target)
    response = redirect(grant)
    response["Cache-Control"] = "no-store"
    return response
