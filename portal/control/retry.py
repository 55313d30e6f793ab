"""A control task's answer that its message should run again later (``workers.control``
re-sends it with Celery's retry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Retry:
    """A handler's answer that its message should run again in ``countdown_s``, with
    ``args`` instead of its own when given (the part that is still to do)."""

    countdown_s: float
    args: tuple[Any, ...] | None = None
