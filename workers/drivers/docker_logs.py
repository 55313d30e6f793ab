"""A container's output for the agent, from the engine's own log (json-file, capped).

Docker keeps a container's stdout and stderr itself; ``container_kwargs`` caps that log at
``cap`` bytes on the host (two files of ``cap/2``: the engine's ``max-size``/``max-file``).
This reader turns the log into the offsets the agent asks for: it remembers, per sandbox,
the timestamp of the last entry it returned and how many bytes came before, and asks the
engine only for what is newer (``since``). An agent restart forgets that: the reader then
starts again from the oldest entry the engine still keeps, counted from 0 (so a sandbox that
printed more than the cap before the restart may show some of its output twice).

The engine stamps stdout and stderr lines in two copiers and writes them to the log as they
come, so an entry can land after a newer one of the other stream (``echo out; echo err >&2``
logged err first, out a few microseconds older but second). The reader therefore never takes
"older than the newest returned" to mean "returned": it asks again from ``_LATE_NS`` (2 s)
before its cursor and skips only the entries it remembers returning in that window.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from workers.drivers.output import OutputChunk


def log_config(cap: int) -> dict[str, Any]:
    """The engine's log settings for a sandbox: at most ``cap`` bytes of it on disk."""
    return {"type": "json-file", "config": {"max-size": str(max(4096, cap // 2)), "max-file": "2"}}


def _stamp(raw: bytes) -> tuple[int, int] | None:
    """(epoch seconds, nanoseconds) of Docker's RFC 3339 timestamp, or None."""
    text = raw.decode("ascii", "replace").rstrip("Z")
    head, _, fraction = text.partition(".")
    try:
        seconds = int(datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp())
    except ValueError:
        return None
    digits = "".join(c for c in fraction if c.isdigit())[:9]
    return seconds, int(digits.ljust(9, "0") or 0)


# How late an entry may land in the log behind a newer one of the other stream and still be
# read: far more than the microseconds measured, since a loaded engine can stall a copier, yet
# short, as every poll reads this much of the log again (a chatty sandbox's thousands of lines).
_LATE_NS = 2 * 10**9

_Entry = tuple[tuple[int, int], int]  # (stamp, hash of its bytes): an entry already returned


def _ns(stamp: tuple[int, int]) -> int:
    return stamp[0] * 10**9 + stamp[1]


@dataclass
class _Cursor:
    last: tuple[int, int]  # the newest entry returned
    end: int  # bytes returned so far
    recent: frozenset[_Entry]  # entries returned no more than _LATE_NS before ``last``


class ContainerLogReader:
    def __init__(self) -> None:
        self._cursors: dict[str, _Cursor] = {}
        self._lock = threading.Lock()

    def forget(self, allocation_key: str) -> None:
        with self._lock:
            self._cursors.pop(allocation_key, None)

    def read(self, container: Any, allocation_key: str, offset: int, limit: int) -> OutputChunk:
        with self._lock:
            cursor = self._cursors.get(allocation_key)
        # A cursor from a read that found nothing yet has no time to resume from: Docker's
        # ``since`` must be positive (0 raised InvalidArgument on the next read).
        if cursor is None or cursor.end != offset or cursor.last <= (0, 0):
            cursor = None
        since = None
        if cursor is not None:
            since = max(_ns(cursor.last) - _LATE_NS, 1) / 1e9
        raw = container.logs(stdout=True, stderr=True, timestamps=True, since=since)
        position = cursor.end if cursor is not None else 0
        newest = cursor.last if cursor is not None else (0, 0)
        floor = _ns(newest) - _LATE_NS
        returned = cursor.recent if cursor is not None else frozenset()
        seen = set(returned)
        start: int | None = None
        parts: list[bytes] = []
        for line in raw.splitlines(keepends=True):
            stamp_raw, _, content = line.partition(b" ")
            stamp = _stamp(stamp_raw)
            if stamp is None:
                continue
            entry = (stamp, hash(content))
            if cursor is not None and (_ns(stamp) < floor or entry in returned):
                continue  # returned before (``since`` asked from before the cursor)
            if position + len(content) <= offset:  # already delivered (after a restart)
                position += len(content)
                newest = max(newest, stamp)
                seen.add(entry)
                continue
            if start is None:
                start = position
            if sum(map(len, parts)) >= limit:
                break
            parts.append(content)
            position += len(content)
            newest = max(newest, stamp)
            seen.add(entry)
        data = b"".join(parts)
        if start is None:
            start = position
        keep = frozenset(e for e in seen if _ns(e[0]) >= _ns(newest) - _LATE_NS)
        with self._lock:
            self._cursors[allocation_key] = _Cursor(last=newest, end=start + len(data), recent=keep)
        return OutputChunk(start=start, data=data, total=start + len(data))
