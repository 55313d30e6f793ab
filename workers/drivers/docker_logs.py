"""A container's output for the agent, from the engine's own log (json-file, capped).

Docker keeps a container's stdout and stderr itself; ``container_kwargs`` caps that log at
``cap`` bytes on the host (two files of ``cap/2``: the engine's ``max-size``/``max-file``).
This reader turns the log into the offsets the agent asks for: it remembers, per sandbox,
the timestamp of the last entry it returned and how many bytes came before, and asks the
engine only for what is newer (``since``). An agent restart forgets that: the reader then
starts again from the oldest entry the engine still keeps, counted from 0 (so a sandbox that
printed more than the cap before the restart may show some of its output twice).
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


@dataclass
class _Cursor:
    last: tuple[int, int]  # the newest entry returned
    end: int  # bytes returned up to and including it


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
        resume = cursor is not None and cursor.end == offset and cursor.last > (0, 0)
        since = None
        if resume and cursor is not None:
            since = cursor.last[0] + cursor.last[1] / 1e9
        raw = container.logs(stdout=True, stderr=True, timestamps=True, since=since)
        position = cursor.end if resume and cursor is not None else 0
        last = cursor.last if resume and cursor is not None else (0, 0)
        start: int | None = None
        parts: list[bytes] = []
        for line in raw.splitlines(keepends=True):
            stamp_raw, _, content = line.partition(b" ")
            stamp = _stamp(stamp_raw)
            if stamp is None or stamp <= last:
                continue  # before the cursor (``since`` includes its own second)
            if position + len(content) <= offset:  # already delivered (after a restart)
                position += len(content)
                last = stamp
                continue
            if start is None:
                start = position
            if sum(map(len, parts)) >= limit:
                break
            parts.append(content)
            position += len(content)
            last = stamp
        data = b"".join(parts)
        if start is None:
            start = position
        with self._lock:
            self._cursors[allocation_key] = _Cursor(last=last, end=start + len(data))
        return OutputChunk(start=start, data=data, total=start + len(data))
