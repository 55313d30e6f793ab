"""Placement policies: given a snapshot and one request, pick devices or say why not."""

from __future__ import annotations

from typing import Protocol

from scheduler.cluster import Pending, Place, Request, Snapshot
from scheduler.placement.firstfit import FirstFit
from scheduler.placement.gpushare import GpusharePolicy

# What the portal runs unless SCHEDULER_POLICY says otherwise, and what the benchmarks measure.
DEFAULT_POLICY = "gpushare"
POLICY_NAMES = ("gpushare", "first-fit")


class Policy(Protocol):
    name: str

    def place(self, snapshot: Snapshot, request: Request, explain: bool = True) -> Place | Pending:
        """Devices for ``request`` on ``snapshot``, or why not. Without ``explain`` a Pending's
        reason may be empty: working it out scans the whole fleet, and a caller that will
        not show it (the cycle, behind a reserved queue head) need not pay for it."""
        ...


def get_policy(name: str) -> Policy:
    """A new placement policy by name: ``gpushare`` (the default) or ``first-fit`` (a plain
    baseline)."""
    policies: dict[str, type[Policy]] = {"first-fit": FirstFit, "gpushare": GpusharePolicy}
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(policies))}") from None
