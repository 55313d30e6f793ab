"""Persistent storage on a GPU host: the directories a sandbox's mounts name, made safe to bind.

A launch message names each mount by a path *relative to* the host's storage root
(``STORAGE_ROOT``: in production a shared file system mounted at the same place on every GPU
host, so a home written on one host is there on the next). The agent resolves it here and
refuses anything the admin did not allow: an absolute or unnormalised path, ``..``, or a
path whose symlinks lead out of the root. A forged or corrupted message cannot bind a host
path into a sandbox.

Ownership: each sandbox runs as a uid of its own (``uids``), so a directory that must
outlive it cannot belong to its uid. It belongs to a group of its own instead (a *volume*'s
gid, ``uids.storage_gid``): root-owned, mode 2770, set-group-id so that what a sandbox
writes keeps the group, with a default POSIX ACL that gives the group read-write on
everything created inside whatever umask the program set. Every sandbox that mounts the
volume runs with that gid as a supplementary group, so its owner's next sandbox, on any
host and under any uid (an MPS share's included), can go on with the files. Datasets are
bound read-only and need no group.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from workers.drivers.base import DriverError, StorageMount

log = logging.getLogger(__name__)

# Where a sandbox may not mount storage: its system trees, the places the drivers give a
# private tmpfs or device nodes, and the root itself.
FORBIDDEN_TARGETS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys",
                     "/tmp", "/usr", "/var")  # fmt: skip  # noqa: S108 - the sandbox's paths
VOLUME_MODE = 0o2770  # set-group-id, owner and group only

# The kernel's POSIX ACL extended attribute (linux/posix_acl_xattr.h): a version, then
# (tag, permissions, id) entries. A default ACL of just these three is enough to stop the
# umask from applying (acl(5)): new files get the group's rw whatever the program's umask.
_ACL_XATTR_VERSION = 2
_ACL_USER_OBJ, _ACL_GROUP_OBJ, _ACL_OTHER = 0x01, 0x04, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
DEFAULT_ACL = struct.pack("<I", _ACL_XATTR_VERSION) + b"".join(
    struct.pack("<HHI", tag, perm, _ACL_UNDEFINED_ID)
    for tag, perm in ((_ACL_USER_OBJ, 7), (_ACL_GROUP_OBJ, 7), (_ACL_OTHER, 0))
)


@dataclass(frozen=True)
class BoundStorage:
    """A mount resolved on this host: what the driver binds where."""

    host_path: str
    target: str
    read_only: bool
    gid: int  # the supplementary group the sandbox runs with; 0 for a read-only dataset
    volume: int


def checked_target(target: str) -> str:
    if not target.startswith("/") or posixpath.normpath(target) != target or "\0" in target:
        raise DriverError(f"storage mount point {target!r} is not an absolute, normalised path")
    for forbidden in FORBIDDEN_TARGETS:
        if target == forbidden or (forbidden != "/" and target.startswith(forbidden + "/")):
            raise DriverError(f"storage may not be mounted at {target}: {forbidden} is the sandbox's own")
    return target


def checked_source(source: str) -> str:
    parts = source.split("/")
    if not source or source.startswith("/") or "\0" in source or any(p in ("", ".", "..") for p in parts):
        raise DriverError(f"storage path {source!r} is not a plain path under the storage root")
    return source


def resolve(
    root: Path, mounts: tuple[StorageMount, ...], *, bound_by_sandbox: bool = False
) -> list[BoundStorage]:
    """Each mount's host directory under ``root``, checked, and for a read-write volume made
    (and its group, mode and default ACL set); a missing dataset is a launch error.
    ``bound_by_sandbox``: the sandbox's own uid makes the binds (bubblewrap), not a root
    daemon (Docker, libvirt's virtiofsd), so it must be able to reach the root."""
    bound: list[BoundStorage] = []
    targets: set[str] = set()
    real_root = os.path.realpath(root)
    if mounts and bound_by_sandbox:
        check_reachable(real_root)
    for mount in mounts:
        target = checked_target(mount.target)
        if target in targets:
            raise DriverError(f"two storage mounts at {target}")
        targets.add(target)
        path = os.path.join(real_root, checked_source(mount.source))
        if not mount.read_only:
            _make_volume(Path(real_root), path, mount.gid)
        if os.path.realpath(path) != path:  # a symlink on the way: it could lead anywhere
            raise DriverError(f"storage {mount.name}: {mount.source} leads out of the storage root")
        if not os.path.isdir(path):
            raise DriverError(f"storage {mount.name}: {mount.source} is missing under {real_root} here")
        gid = 0 if mount.read_only else mount.gid
        bound.append(BoundStorage(path, target, mount.read_only, gid, mount.volume))
    return bound


def check_reachable(root: str, what: str = "storage root") -> None:
    """The sandboxes' uids (no host account's, in no group of the host's) must be able to
    pass through every directory above the root: else bubblewrap's bind, made as the
    sandbox's uid, fails with a bare "permission denied"."""
    here = root
    while here != "/":
        here = os.path.dirname(here)
        try:
            mode = os.stat(here).st_mode
        except OSError as exc:
            raise DriverError(f"{what} {root}: {here} cannot be read ({exc.strerror})") from exc
        if not mode & stat.S_IXOTH:
            raise DriverError(
                f"{what} {root} cannot be reached by sandboxes: {here} is mode "
                f"{stat.S_IMODE(mode):o} (sandbox uids need o+x on every directory above it)"
            )


def _make_volume(root: Path, path: str, gid: int) -> None:
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        # Component by component, never through a symlink: nothing is made outside the root.
        here = str(root)
        for part in os.path.relpath(path, root).split("/"):
            here = os.path.join(here, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(here, VOLUME_MODE if here == path else 0o755)  # parents (homes/): root's
            if os.path.islink(here) or not os.path.isdir(here):
                raise DriverError(f"storage path {here} is not a directory of the storage root")
        if os.geteuid() == 0 and gid:
            # The top directory only, at every launch: cheap, and it mends a mode or group an
            # admin's copy disturbed. What is inside keeps the group by set-group-id.
            info = os.lstat(path)
            if info.st_gid != gid or info.st_uid != 0:
                os.chown(path, 0, gid)
            if stat.S_IMODE(info.st_mode) != VOLUME_MODE:
                os.chmod(path, VOLUME_MODE)
        _set_default_acl(path)
    except OSError as exc:
        raise DriverError(f"cannot prepare storage {path}: {exc.strerror or exc}") from exc


def _set_default_acl(path: str) -> None:
    try:
        if os.getxattr(path, "system.posix_acl_default") == DEFAULT_ACL:
            return
    except OSError:
        pass
    try:
        os.setxattr(path, "system.posix_acl_default", DEFAULT_ACL)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # NFS without ACLs: the group still owns everything (set-group-id), but a file made
        # under umask 022 is read-only to the owner's next sandbox until chmod g+w.
        log.warning("storage %s: the file system takes no POSIX ACLs; the umask applies", path)


def measure(path: str, deadline_s: float = 60.0) -> tuple[int, bool]:
    """Bytes ``path`` takes on disk (allocated blocks, each hard-linked file once), and
    whether the walk finished before ``deadline_s``: a partial figure is a lower bound."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [path]
    ends = time.monotonic() + deadline_s
    while stack:
        if time.monotonic() > ends:
            return total, False
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue  # gone meanwhile, or unreadable: counted as nothing
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_nlink > 1:
                key = (info.st_dev, info.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                stack.append(entry.path)
    return total, True
