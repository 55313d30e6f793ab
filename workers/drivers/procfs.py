"""Reading /proc for the process driver: a process's state and start time (to tell it from
a later process given the same pid), the members of a pid namespace, signalling a set."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after its last ")".
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


def alive(pid: int, start_ticks: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[1] == start_ticks and stat[0] not in ("Z", "X")


def pids_in_namespace(pidns: str) -> list[int]:
    """Host pids of the processes in the pid namespace ``pid:[inode]``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "pid") == pidns:
                pids.append(int(entry.name))
    return pids


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
