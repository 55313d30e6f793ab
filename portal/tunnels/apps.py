from django.apps import AppConfig


class TunnelsConfig(AppConfig):
    """The terminal and the sandboxes' web apps, reached through the host agent's relay. No
    models: grants and app sessions live in the cache."""

    name = "portal.tunnels"
    label = "tunnels"
