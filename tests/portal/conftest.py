"""Fixtures for the portal's tests beyond the personas of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.cache import cache

from tests.portal.smtp import Inbox, smtp_server


@pytest.fixture
def smtp() -> Iterator[Inbox]:
    """A real SMTP server on loopback receiving the portal's mails (the cache emptied
    around it: password-reset requests are counted there)."""
    cache.clear()
    with smtp_server() as inbox:
        yield inbox
    cache.clear()
