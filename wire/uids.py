"""The host uids sandboxes run as, from a range no host account uses.

A sandbox process on the host runs as an unprivileged uid: its owner's (``owner_uid``), as a
Slurm job runs as its user, so that what one of their sandboxes writes in their home (tools
make 0700 folders there: Jupyter's data, IPython's security, ssh) is theirs in the next; a
sandbox with no owner named (an agent's self-test) gets one of its own (``sandbox_uid``).
Different people's sandboxes never share a uid, so they cannot signal, trace or read one
another's processes and files, and nothing a sandbox does counts as a person's doing on the
host (uid 1000 is usually the first human login). The range starts at ``SANDBOX_UID_BASE``
(1,000,000,000, above login users and the subordinate ranges user-namespace tools hand
out); ``check_range`` refuses to start a driver when /etc/passwd, /etc/subuid or
/etc/subgid reaches into it.

MPS is the exception NVIDIA imposes: one MPS server serves one uid at a time, and a client
of another uid waits until that server has no clients left, so the sandboxes sharing a GPU
through MPS share one uid, that GPU's own (``mps_uid``), from a range of its own beside
the sandboxes'. Their namespaces still keep them apart.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from wire.spec import SandboxSpec

SANDBOX_UID_BASE = int(os.environ.get("SANDBOX_UID_BASE") or 1_000_000_000)
SPAN = 1_000_000  # sandboxes' uids, then MPS GPUs', storage volumes' gids, owners' uids


def sandbox_uid(sandbox_id: int) -> int:
    return SANDBOX_UID_BASE + sandbox_id % SPAN


def owner_uid(user_id: int) -> int:
    """The uid a person's sandboxes run as (their portal user id's)."""
    return SANDBOX_UID_BASE + 3 * SPAN + user_id % SPAN


def host_uid(spec: SandboxSpec) -> int:
    """The host uid ``spec``'s processes run as: under MPS its GPU's (one MPS server serves one
    uid at a time), else its owner's, else its own."""
    if spec.mps is not None and spec.device_uuids:
        return mps_uid(spec.device_uuids[0])
    return owner_uid(spec.owner_id) if spec.owner_id else sandbox_uid(spec.sandbox_id)


def storage_gid(volume_id: int) -> int:
    """The group owning a storage volume (a home, a project folder), after the sandboxes'
    and the MPS uids: every sandbox that mounts the volume runs with it."""
    return SANDBOX_UID_BASE + 2 * SPAN + volume_id % SPAN


def mps_uid(device_uuid: str) -> int:
    """The uid every MPS client on this GPU (or MIG device) runs as."""
    return SANDBOX_UID_BASE + SPAN + zlib.crc32(device_uuid.encode()) % SPAN


def in_sandbox_range(host_id: int) -> bool:
    """Whether a host uid or gid is one the sandboxes run as (any of the ranges above)."""
    return SANDBOX_UID_BASE <= host_id < SANDBOX_UID_BASE + 4 * SPAN


def _ranges(path: Path) -> list[tuple[str, int, int]]:
    """(who, first, last) of each entry of a passwd or subuid file."""
    found = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(":")
        try:
            if path.name == "passwd" and len(fields) > 2:
                found.append((fields[0], int(fields[2]), int(fields[2])))
            elif len(fields) == 3:
                found.append((fields[0], int(fields[1]), int(fields[1]) + int(fields[2]) - 1))
        except ValueError:
            continue
    return found


def check_range(etc: Path = Path("/etc")) -> str | None:
    """Why the sandbox uid range cannot be used here (None when it can)."""
    first, last = SANDBOX_UID_BASE, SANDBOX_UID_BASE + 4 * SPAN - 1
    for name in ("passwd", "subuid", "subgid"):
        for who, low, high in _ranges(etc / name):
            if low <= last and high >= first:
                return (
                    f"{etc / name} gives {who} ids {low}-{high}, inside the sandbox uid range "
                    f"{first}-{last}: set SANDBOX_UID_BASE to a range no account uses"
                )
    return None
