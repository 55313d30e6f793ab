"""Byte counts as people read them, the same on the agents' lines and the portal's pages."""

from __future__ import annotations


def human_size(size: float) -> str:
    """ "4 KiB", "5.0 MiB", "9.5 GiB" """
    if size >= 1024**3:
        return f"{size / 1024**3:.1f} GiB"
    return f"{size / 1024**2:.1f} MiB" if size >= 1024**2 else f"{int(size) // 1024} KiB"
