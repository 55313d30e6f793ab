"""The unread-notifications count every page's navigation shows, kept in Django's cache (Redis).

Read on every page and every htmx refresh of every signed-in user, it was a COUNT query per
request for a number that changes a few times a day. Writers forget a user's count after
their commit (``forget``); a count read while a write commits may be cached just before it
and stay stale until UNREAD_TTL_S, a badge a minute behind at worst.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.core.cache import cache
from django.db import transaction

from portal.sandboxes.models import Notification

UNREAD_TTL_S = 60


def _key(user_id: int) -> str:
    return f"notifications:unread:{user_id}"


def unread_count(user_id: int) -> int:
    count = cache.get(_key(user_id))
    if count is None:
        count = Notification.objects.filter(user_id=user_id, read_at=None).count()
        cache.set(_key(user_id), count, UNREAD_TTL_S)
    return int(count)


def forget(user_ids: Iterable[int]) -> None:
    """After the current transaction commits, the next page counts these users' unread again."""
    keys = [_key(pk) for pk in set(user_ids)]
    if keys:
        transaction.on_commit(lambda: cache.delete_many(keys))


def forget_everyone() -> None:
    """Every cached count (tests: a rolled-back test's user id is the next test's)."""
    pattern = cache.make_key(_key(0)).removesuffix("0") + "*"
    client = cache._cache.get_client(write=True)  # type: ignore[attr-defined]  # Django's RedisCache
    keys = list(client.scan_iter(match=pattern, count=1000))
    if keys:
        client.delete(*keys)
