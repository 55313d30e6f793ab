"""Template context every page gets: the signed-in user's unread notifications count (cached:
portal/sandboxes/unread.py)."""

from __future__ import annotations

from django.http import HttpRequest

from portal.sandboxes.unread import unread_count


def notifications(request: HttpRequest) -> dict[str, int]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"unread_notifications": unread_count(int(user.pk))}
