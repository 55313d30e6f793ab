"""Celery app and everything that runs on a GPU host.

``workers.agent`` and ``workers.gpu`` / ``workers.drivers`` never import the ORM: a GPU host
needs only broker credentials.
"""

from wire.celery import app

__all__ = ["app"]
