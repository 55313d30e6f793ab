"""Persistent storage as a launch message names it, and the rules every side holds it to.

The portal checks an admin's storage against these rules when it is saved (a form error);
the agent checks every launch message again before it binds anything
(workers/drivers/storage.py), since a message may be forged or corrupted.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


class StorageRefused(ValueError):
    """A storage path or mount point no launch may carry."""


@dataclass(frozen=True)
class StorageMount:
    """Persistent storage to bind (workers/drivers/storage.py resolves it on the host)."""

    name: str  # the storage's name, for messages
    source: str  # relative to the host's STORAGE_ROOT: never a host path of its own
    target: str  # where the sandbox sees it
    read_only: bool
    gid: int  # the volume's group (uids.storage_gid); 0 for a read-only dataset
    volume: int = 0  # the portal's volume id, to report its usage against; 0 for a dataset


# Where a sandbox may not mount storage: its system trees, the places the drivers give a
# private tmpfs or device nodes, and the root itself.
FORBIDDEN_TARGETS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys",
                     "/tmp", "/usr", "/var")  # fmt: skip  # noqa: S108 - the sandbox's paths


def checked_target(target: str) -> str:
    if not target.startswith("/") or posixpath.normpath(target) != target or "\0" in target:
        raise StorageRefused(f"storage mount point {target!r} is not an absolute, normalised path")
    for forbidden in FORBIDDEN_TARGETS:
        if target == forbidden or (forbidden != "/" and target.startswith(forbidden + "/")):
            raise StorageRefused(f"storage may not be mounted at {target}: {forbidden} is the sandbox's own")
    return target


def checked_source(source: str) -> str:
    parts = source.split("/")
    if not source or source.startswith("/") or "\0" in source or any(p in ("", ".", "..") for p in parts):
        raise StorageRefused(f"storage path {source!r} is not a plain path under the storage root")
    return source
