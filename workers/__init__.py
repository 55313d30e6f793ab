"""Celery app, the two workers' entries and everything that runs on a GPU host.

``workers.control`` is the control worker's entry (into ``portal.control``);
``workers.agent`` the host agent's, whose parts are ``workers.host``. The agent,
``workers.gpu`` and ``workers.drivers`` never import the ORM: a GPU host needs only broker
credentials.
"""

from wire.celery import app

__all__ = ["app"]
