"""Hold Python's cyclic garbage collector off during a short piece of latency-bound work.

Here, with the cycle that uses it (``run_cycle`` holds it, so every caller does: the control
worker, the portal's preview, the replays), not in the portal that also holds it around its
reads. The scheduling cycle reads tens of thousands of rows into short-lived objects, and a
preview builds thousands more. Their allocations trip the collector's thresholds, and
each full collection walks every live object of the process (Django, the policy's
memoised scores, the kept fleet): measured at the openb cluster's size, collections took
a third of a cycle (0.45 s of 0.55 s with them, 0.30 s without) and turned 30 ms previews
into 200 ms ones now and then. What the work leaves behind is freed by reference counting
as usual; only cycles of garbage wait, for the first collection after the work ends.

Process-wide and nestable across threads: the collector is back on when the last holder
leaves, and stays off if someone had turned it off before.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def collection_paused() -> Iterator[None]:
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
