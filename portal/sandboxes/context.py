"""Template context every page gets: the signed-in user's unread notifications count."""

from __future__ import annotations

from django.http import HttpRequest

from portal.sandboxes.models import Notification


def notifications(request: HttpRequest) -> dict[str, int]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"unread_notifications": Notification.objects.filter(user=user, read_at=None).count()}
