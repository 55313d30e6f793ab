from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    """Notification mail: which kinds each user has mailed, and the sending. No models yet:
    ``Notification`` and ``EmailChoice`` are the sandboxes app's, written by its ``notify``."""

    name = "portal.notifications"
    label = "notifications"
