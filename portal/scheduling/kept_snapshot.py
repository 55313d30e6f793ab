"""One fleet ``Snapshot`` kept across reads, for a placement policy that remembers its scores
per snapshot: while the fleet's layout stays the same, a new read replaces only the hosts
that differ and reports them changed (``Snapshot.changed``), so the scores remembered for
every other host carry over and a decision costs what changed, not requests x GPUs.

Used by both sides that keep one: the control worker's cycle over what it read from the
database (``policy.kept_fleet``, hosts as ``HostState``) and the web server's preview over the
digest the cycle left (``digest.Mirror.follow``, hosts as the digest's rows, turned into
``HostState`` only when they changed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from scheduler.cluster import HostState, Snapshot

# A kept snapshot's change log grows with use (bookings, the queue head's devices hidden and
# shown again at every attempt): past this many entries per host a fresh one is started, and
# scored once.
CHANGES_PER_HOST = 20

Row = TypeVar("Row")


def host_layout(host: HostState) -> tuple[Any, ...]:
    """What a policy may have built on for the whole fleet, of one host: its name, capacity
    and isolation, and each GPU's UUID, model and sharing mode. Not what is free."""
    return (
        host.name,
        host.cpu_milli,
        host.memory_mib,
        host.isolation_levels,
        [(g.uuid, g.model, g.mode) for g in host.gpus],
    )


def worn(snapshot: Snapshot) -> bool:
    """Whether its change log has grown past ``CHANGES_PER_HOST`` per host."""
    return len(snapshot.changes) > CHANGES_PER_HOST * max(1, len(snapshot.hosts))


def follow(
    kept: Snapshot | None,
    old: Sequence[Row],
    new: Sequence[Row],
    *,
    layout: Callable[[Row], object],
    host: Callable[[Row], HostState],
    rebuild: Callable[[], Snapshot],
) -> Snapshot:
    """``kept`` brought up to date from ``old`` (what it was built from) to ``new``: each host
    whose row differs replaced by ``host(row)`` and reported changed. ``rebuild()`` instead
    when there is none kept, it is worn, or the layout changed (hosts added, removed or
    reordered, a ``layout`` that differs). Either way the hosts are exactly ``new``'s; what
    runs on them is the caller's to set."""
    if kept is None or worn(kept) or len(new) != len(old):
        return rebuild()
    changed = [i for i, row in enumerate(new) if row != old[i]]
    if any(layout(new[i]) != layout(old[i]) for i in changed):
        return rebuild()
    for i in changed:
        state = host(new[i])
        kept.hosts[i] = state
        kept.changed(state.name)
    return kept
