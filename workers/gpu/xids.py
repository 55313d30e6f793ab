"""PLACEHOLDER until the nvml branch lands (it owns the XID table)."""

from __future__ import annotations

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def is_application_xid(xid: int) -> bool:
    return xid in APPLICATION_XIDS


def describe_xid(xid: int) -> str:
    return {79: "GPU has fallen off the bus"}.get(xid, "an XID")
