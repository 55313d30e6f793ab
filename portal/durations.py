"""Lengths of time as the portal writes them, the one way, for settings (a tier's limit, a
preemption's grace), usage records and messages alike:

- below a minute, seconds to a tenth: "3.4 s", "30 s";
- a round length in one unit, the largest it is a whole number of, while that number stays
  under 100: "90 s", "10 min", "3 h" (as an operator types it, and as a limit reads);
- anything else in the two largest units that are not zero: "2 h 5 min", "12 min 5 s",
  "2 h 3 min". Two say enough: nobody reads "2 h 3 min 7 s" for its seconds.
"""

from __future__ import annotations

from datetime import timedelta

_UNITS = (("h", 3600), ("min", 60), ("s", 1))
ROUND_BELOW = 100  # "90 min" reads at a glance, "125 min" does not: "2 h 5 min"


def duration_text(length: timedelta | float) -> str:
    """``length`` (a timedelta, or seconds) in words: see the module's docstring."""
    seconds = round(length.total_seconds() if isinstance(length, timedelta) else float(length), 1)
    if seconds < 60:
        return f"{seconds:g} s"
    for name, size in _UNITS:
        if seconds % size == 0 and seconds // size < ROUND_BELOW:
            return f"{int(seconds // size)} {name}"
    rest = int(seconds)
    parts: list[tuple[int, str]] = []
    for name, size in _UNITS:
        count, rest = divmod(rest, size)
        if count or parts:  # from the largest unit that is not zero, two units in all
            parts.append((count, name))
    return " ".join(f"{count} {name}" for count, name in parts[:2] if count)
