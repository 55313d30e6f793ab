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

Tenants write inside their volumes, never above them: every directory between the root and a
volume (``homes/``...) must be writable by its owner alone, an owner no sandbox runs as,
else a sandbox could swap it for a symlink after the agent checked the path and before
Docker, libvirt or bubblewrap bind it by name. The agent itself reaches a volume component
by component without following a link (workers/drivers/tenant_paths.py), sets its group,
mode and ACL through that descriptor, and measures it the same way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import secrets
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wire import uids
from wire.storage import StorageMount, StorageRefused, checked_source, checked_target
from workers.drivers import tenant_paths
from workers.drivers.base import DriverError

log = logging.getLogger(__name__)

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


def _checked(check: Callable[[str], str], value: str) -> str:
    """``check(value)``, its refusal as the driver's error (a launch's reason)."""
    try:
        return check(value)
    except StorageRefused as exc:
        raise DriverError(str(exc)) from exc


def resolve(
    root: Path, mounts: tuple[StorageMount, ...], *, bound_by_sandbox: bool = False, folder: str = ""
) -> list[BoundStorage]:
    """Each mount's host directory under ``root``, checked, and for a read-write volume made
    (and its group, mode and default ACL set); a missing dataset is a launch error.
    ``bound_by_sandbox``: the sandbox's own uid makes the binds (bubblewrap), not a root
    daemon (Docker, libvirt's virtiofsd), so it must be able to reach the root. ``folder``: a
    path the sandbox sees inside one of its read-write mounts (its checkpoint folder), made
    there before it starts."""
    bound: list[BoundStorage] = []
    targets: set[str] = set()
    inside = _folder_inside(mounts, folder) if folder else None
    real_root = os.path.realpath(root)
    if mounts and bound_by_sandbox:
        check_reachable(real_root)
    for mount in mounts:
        target = _checked(checked_target, mount.target)
        if target in targets:
            raise DriverError(f"two storage mounts at {target}")
        targets.add(target)
        source = _checked(checked_source, mount.source)
        volume = _open_volume(real_root, source, mount.name, make=not mount.read_only)
        try:
            if not mount.read_only:
                _prepare_volume(volume, os.path.join(real_root, source), mount.gid)
            if inside is not None and inside[0] is mount:
                _make_folder(volume, inside[1], mount.name)
        finally:
            os.close(volume)
        path = os.path.join(real_root, source)  # safe to bind by name: nothing above it moves
        gid = 0 if mount.read_only else mount.gid
        bound.append(BoundStorage(path, target, mount.read_only, gid, mount.volume))
    return bound


def _folder_inside(mounts: tuple[StorageMount, ...], folder: str) -> tuple[StorageMount, str]:
    """The read-write mount ``folder`` lies in, and its path below the mount point."""
    if not folder.startswith("/") or posixpath.normpath(folder) != folder or "\0" in folder:
        raise DriverError(f"folder {folder!r} is not an absolute, normalised path")
    for mount in sorted(mounts, key=lambda m: -len(m.target)):
        if not mount.read_only and folder.startswith(mount.target.rstrip("/") + "/"):
            return mount, folder[len(mount.target.rstrip("/")) + 1 :]
    raise DriverError(f"folder {folder} is in none of the sandbox's read-write storage")


def _make_folder(volume: int, relative: str, name: str) -> None:
    """Make ``relative`` (``a/b``) in a volume the tenant writes: one name at a time, each
    opened without following a link, since the tenant may have planted one at any of them.
    Made by the agent, a folder is the volume's group's (set-group-id), group-writable. The
    last one must be the agent's own: one made in its place by someone else (a sandbox id is
    easy to guess) is moved aside, so that no one hands a sandbox its first "checkpoint"."""
    here = os.dup(volume)
    parts = relative.split("/")
    try:
        for depth, part in enumerate(parts, 1):
            made = True
            try:
                os.mkdir(part, VOLUME_MODE, dir_fd=here)
            except FileExistsError:
                made = False
                if depth == len(parts) and _planted(here, part):
                    aside = f"{part}.not-made-by-gpushare-{secrets.token_hex(4)}"
                    os.rename(part, aside, src_dir_fd=here, dst_dir_fd=here)
                    log.warning(
                        "storage %s: %s was not made by gpushare: moved aside to %s", name, relative, aside
                    )
                    os.mkdir(part, VOLUME_MODE, dir_fd=here)
                    made = True
            try:
                step = tenant_paths.open_beneath(here, part, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                raise DriverError(
                    f"storage {name}: cannot make {relative}: {part} is not a plain folder ({exc.strerror})"
                ) from exc
            os.close(here)
            here = step
            if made:  # the umask (no default ACL on this file system) must not take the group's w
                os.fchmod(here, VOLUME_MODE)
    except OSError as exc:
        raise DriverError(f"storage {name}: cannot make {relative}: {exc.strerror or exc}") from exc
    finally:
        os.close(here)


def _planted(folder: int, part: str) -> bool:
    """Whether ``part`` in ``folder`` is a name the agent did not make: anything but a folder
    of root's (a root agent makes them all; an unprivileged one, in tests, cannot tell)."""
    if os.geteuid() != 0:
        return False
    info = os.stat(part, dir_fd=folder, follow_symlinks=False)
    return not stat.S_ISDIR(info.st_mode) or info.st_uid != 0


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


def _open_volume(root: str, source: str, name: str, *, make: bool) -> int:
    """A descriptor of the directory ``source`` under ``root``, reached one component at a time
    without following a symlink (made 0755, the volume itself 2770, when ``make``); each
    directory above it checked to be one no sandbox can write."""
    try:
        if make:
            os.makedirs(root, mode=0o755, exist_ok=True)
        here = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DriverError(f"storage {name}: cannot open the storage root {root}: {exc.strerror}") from exc
    parts = source.split("/")
    try:
        for depth, part in enumerate(parts, 1):
            last = depth == len(parts)
            at = "/".join(parts[:depth])
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, VOLUME_MODE if last else 0o755, dir_fd=here)  # parents: root's
            try:
                step = tenant_paths.open_beneath(here, part, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                raise DriverError(_unreachable(name, source, at, root, exc)) from exc
            os.close(here)
            here = step
            if not last:
                _check_host_only(os.fstat(here), name, os.path.join(root, at))
    except BaseException:
        os.close(here)
        raise
    return here


def _unreachable(name: str, source: str, at: str, root: str, exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.EXDEV):  # a symlink or a mount on the way: could lead anywhere
        return f"storage {name}: {source} leads out of the storage root ({at} is a link or a mount point)"
    if exc.errno == errno.ENOENT:
        return f"storage {name}: {source} is missing under {root} here"
    if exc.errno == errno.ENOTDIR:
        return f"storage {name}: {at} is not a directory of the storage root"
    return f"cannot prepare storage {os.path.join(root, source)}: {exc.strerror or exc}"


def _check_host_only(info: os.stat_result, name: str, path: str) -> None:
    """A directory above a volume: writable by its owner only, an owner that is no sandbox's uid."""
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or uids.in_sandbox_range(info.st_uid):
        raise DriverError(
            f"storage {name}: {path} (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}) can be "
            "written by sandboxes or a group: a volume may only lie below directories only the host writes"
        )


def _prepare_volume(volume: int, path: str, gid: int) -> None:
    """The volume's group, mode and default ACL, set through its descriptor."""
    try:
        if os.geteuid() == 0 and gid:
            # The top directory only, at every launch: cheap, and it mends a mode or group an
            # admin's copy disturbed. What is inside keeps the group by set-group-id.
            info = os.fstat(volume)
            if info.st_gid != gid or info.st_uid != 0:
                os.chown(volume, 0, gid)
            if stat.S_IMODE(info.st_mode) != VOLUME_MODE:
                os.chmod(volume, VOLUME_MODE)
        _set_default_acl(volume, path)
    except OSError as exc:
        raise DriverError(f"cannot prepare storage {path}: {exc.strerror or exc}") from exc


def _set_default_acl(volume: int, path: str) -> None:
    try:
        if os.getxattr(volume, "system.posix_acl_default") == DEFAULT_ACL:
            return
    except OSError:
        pass
    try:
        os.setxattr(volume, "system.posix_acl_default", DEFAULT_ACL)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # NFS without ACLs: the group still owns everything (set-group-id), but a file made
        # under umask 022 is read-only to the owner's next sandbox until chmod g+w.
        log.warning("storage %s: the file system takes no POSIX ACLs; the umask applies", path)


def measure(root: Path, source: str, deadline_s: float = 60.0) -> tuple[int, bool] | None:
    """Bytes the volume ``source`` under ``root`` takes on disk (allocated blocks, each
    hard-linked file once), and whether the walk finished before ``deadline_s``: a partial
    figure is a lower bound. None when it is not there (or not a directory reached without
    a link). The tenant writes in it while it is walked: nothing is followed
    (``tenant_paths.walk``)."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        volume = tenant_paths.open_beneath(root_fd, checked_source(source), os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, StorageRefused):
        return None
    finally:
        os.close(root_fd)
    total = 0
    seen: set[tuple[int, int]] = set()
    ends = time.monotonic() + deadline_s
    try:
        for _, _, info in tenant_paths.walk(volume):
            if time.monotonic() > ends:
                return total, False
            if info is None:
                continue
            if info.st_nlink > 1:
                key = (info.st_dev, info.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += info.st_blocks * 512
    except OSError:  # a folder moved while we were in it, or one we may not read
        return total, False
    finally:
        os.close(volume)
    return total, True
