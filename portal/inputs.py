"""Parsing what people type into query strings and form fields, the one way.

``str.isdigit`` is no test for a number: it accepts "²", "٣" and other Unicode digits that
``int`` refuses (a 500), and it accepts a thousand digits that overflow a database column.
"""

from __future__ import annotations

MAX_DIGITS = 18  # a PostgreSQL bigint holds any 18-digit number


def plain_text(raw: str, max_length: int) -> str | None:
    """``raw`` when a database text column can hold it and compare it: no NUL byte (PostgreSQL
    refuses one outright, a 500), at most ``max_length`` characters; else None."""
    return raw if "\x00" not in raw and len(raw) <= max_length else None


def whole_number(raw: str | None, low: int = 0, high: int = 10**MAX_DIGITS - 1) -> int | None:
    """``raw`` as an int within ``[low, high]`` when it is plain ASCII digits, else None."""
    if raw is None or not raw or len(raw) > MAX_DIGITS or not (raw.isascii() and raw.isdigit()):
        return None
    number = int(raw)
    return number if low <= number <= high else None
