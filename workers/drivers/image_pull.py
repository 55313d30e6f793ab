"""Pulling an image an admin approved (portal/catalog/registries.py), with the progress a
sandbox's page shows while it starts.

Docker's pull answers with a stream of events, one per layer and step ("Pulling fs layer",
"Downloading" with bytes so far and in all, "Download complete", "Pull complete",
"Already exists"); ``PullProgress`` sums them into one line a person can read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from wire.sizes import human_size
from workers.drivers.base import DriverError

REPORT_EVERY_S = 2.0  # a line per this many seconds at most: each is a message to the control worker
_DONE = frozenset(
    {"Download complete", "Pull complete", "Already exists", "Verifying Checksum", "Extracting"}
)


class PullProgress:
    """The layers of one pull, and where each is."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.layers: dict[str, tuple[int, int]] = {}  # id -> (bytes so far, bytes in all)
        self.done: set[str] = set()

    def update(self, event: dict[str, Any]) -> None:
        if event.get("error"):
            raise DriverError(f"pull of {self.image} failed: {event['error']}")
        layer, status = event.get("id"), str(event.get("status", ""))
        if not layer or status.startswith(("Pulling from", "Digest", "Status")):
            return  # the pull's own lines (its id is the tag), not a layer's
        detail = event.get("progressDetail") or {}
        if status == "Downloading" and detail.get("total"):
            self.layers[layer] = (int(detail.get("current", 0)), int(detail["total"]))
        else:
            self.layers.setdefault(layer, (0, 0))
        if status in _DONE:
            self.done.add(layer)
            got, total = self.layers[layer]
            self.layers[layer] = (total, total) if total else (got, got)

    def line(self, finished: bool = False) -> str:
        if not self.layers:  # none named yet, or every one was on this host already
            return (
                f"pulled {self.image}: its layers were on this host" if finished else f"pulling {self.image}"
            )
        got = sum(current for current, _ in self.layers.values())
        total = sum(whole for _, whole in self.layers.values())
        size = f", {human_size(got)} of {human_size(total)}" if total else ""
        return f"pulling {self.image}: {len(self.done)} of {len(self.layers)} layers{size}"


def follow(image: str, events: Iterable[dict[str, Any]], report: Callable[[str], None]) -> None:
    """Read a pull's ``events`` to the end, calling ``report`` with its progress once its
    layers are known, then every REPORT_EVERY_S, and once at the end; DriverError when the
    pull failed."""
    progress = PullProgress(image)
    last = 0.0
    for event in events:
        progress.update(event)
        if progress.layers and time.monotonic() - last >= REPORT_EVERY_S:
            last = time.monotonic()
            report(progress.line())
    report(progress.line(finished=True))
