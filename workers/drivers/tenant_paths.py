"""Folders a tenant can write, touched by the agent (root) without following what it planted.

A sandbox's app socket folder, its storage volumes and its GPU's MPS pipe directory are bound
into it read-write, so the tenant can put a symlink, a hard link, a FIFO or a directory in
place of any name inside. The agent works in the host's mount namespace as root: a path
string it opens there is resolved as root, and a planted symlink leads anywhere on the host
(Docker's socket, another sandbox's files through ``/proc/<pid>/root``, a device node whose
open has effects). So, in every folder a tenant writes:

* a name is opened beneath a descriptor of the folder with openat2(2) and
  ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``
  (``STRICT``): a symlink on the way, a ``..`` out of the folder or another mount fails the
  open instead of being followed;
* what was opened is checked on its descriptor (``require``): its type, its owner and, where
  its content matters, that it has no second name (a hard link to another's file);
* it is then used through that descriptor (``connect`` to ``/proc/self/fd/N``, ``fchown``,
  ``read``), never by name again, so nothing can be swapped in between.

Trees (a volume to measure, a stale app folder to remove) are walked the same way, with a
constant number of descriptors whatever their depth (``walk``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import stat
from collections.abc import Generator, Iterator

# openat2(2) (linux/openat2.h): the resolve flags, and its number on x86_64 and aarch64
# (the generic table; Linux 5.6+).
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


class UnsafePath(OSError):
    """A name in a tenant's folder is not what the agent may use (a planted link, a FIFO,
    someone else's file). An OSError: callers that treat a missing file as one keep doing so."""


class TreeMoved(OSError):
    """A directory being walked was moved (by its tenant) while the walk was inside it."""


# Kernels without openat2 (before 5.6): the same resolution, one component at a time.
openat2_missing = _SYS_OPENAT2 is None


def open_beneath(dir_fd: int, relative: str, flags: int, mode: int = 0) -> int:
    """A descriptor of ``relative`` (a path below ``dir_fd``, never absolute), opened with
    ``flags`` (plus ``O_CLOEXEC``) and resolved under ``STRICT``: no symlink is followed, not even
    the last component's, none is left, and no other mount entered. With ``O_PATH |
    O_NOFOLLOW`` a final symlink is opened itself (openat2's rule): ``require`` its type."""
    global openat2_missing
    flags |= os.O_CLOEXEC
    if not openat2_missing:
        how = _OpenHow(flags, mode, STRICT)
        fd = _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2 or 0),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(relative)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), relative)
        openat2_missing = True
    return _open_by_components(dir_fd, relative, flags, mode)


def _open_by_components(dir_fd: int, relative: str, flags: int, mode: int) -> int:
    """``open_beneath`` without openat2: each directory on the way opened with ``O_NOFOLLOW``
    from the last one, ``..`` refused, and the device checked to stay the folder's."""
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EXDEV, "not a plain path beneath the folder", relative)
    device = os.fstat(dir_fd).st_dev
    here = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            os.close(here)
            here = step
            info = os.fstat(here)
            if stat.S_ISLNK(info.st_mode):
                raise OSError(errno.ELOOP, "a symlink on the way", relative)
            if not stat.S_ISDIR(info.st_mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), relative)
            if info.st_dev != device:
                raise OSError(errno.EXDEV, "another mount on the way", relative)
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=here)
    finally:
        os.close(here)
    if os.fstat(fd).st_dev != device:
        os.close(fd)
        raise OSError(errno.EXDEV, "another mount on the way", relative)
    return fd


def require(
    fd: int, what: str, kind: int, *, owner: int | None = None, single_link: bool = False
) -> os.stat_result:
    """``fd``'s stat, when it is of ``kind`` (``stat.S_IFSOCK``...), belongs to ``owner``
    and, with ``single_link``, has one name only; else UnsafePath naming what it is."""
    info = os.fstat(fd)
    if stat.S_IFMT(info.st_mode) != kind:
        raise UnsafePath(errno.EPERM, f"{what} is a {_kind(info.st_mode)}, not a {_kind(kind)}")
    if owner is not None and info.st_uid != owner:
        raise UnsafePath(errno.EPERM, f"{what} belongs to uid {info.st_uid}, not {owner}")
    if single_link and info.st_nlink != 1:
        raise UnsafePath(errno.EPERM, f"{what} has {info.st_nlink} names (a hard link)")
    return info


_KINDS = {
    stat.S_IFSOCK: "socket", stat.S_IFLNK: "symlink", stat.S_IFREG: "file", stat.S_IFDIR: "directory",
    stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
}  # fmt: skip


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "special file")


def open_folder(path: str | os.PathLike[str]) -> int:
    """A descriptor of a tenant's folder itself, whose *name* lives in a folder only the agent
    writes (``<apps>/<allocation>``, an MPS pipe directory): its last component must not be a
    symlink either."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_file(folder_fd: int, name: str, what: str, *, owner: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``name`` in a tenant's folder, when
    ``owner`` wrote it and it has one name. Opened non-blocking: a FIFO planted in its place
    is refused, not waited on, and neither a device nor a link's target is ever opened."""
    fd = open_beneath(folder_fd, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        require(fd, what, stat.S_IFREG, owner=owner, single_link=True)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def walk(top_fd: int) -> Iterator[tuple[int, str, os.stat_result | None]]:
    """Every entry below ``top_fd``, depth first: ``(its folder's descriptor, its name, its
    lstat)``, and ``(folder's descriptor, name, None)`` once a subfolder is done (or could not
    be entered: gone, or swapped for something that is not a directory). The descriptor is
    valid until the next item; a consumer may unlink the entry through it.

    Subfolders are entered with ``open_beneath`` (never through a link, never onto another
    mount) and left through ``..``, which is checked to be the folder we came from: a
    tenant moving a folder while the walk is inside it ends the walk (TreeMoved) rather than
    let it go on elsewhere. One descriptor open at a time, whatever the tree's depth."""
    fd = os.dup(top_fd)
    try:
        key = _key(os.fstat(fd))
        pending = yield from _listed(fd)
        above: list[tuple[tuple[int, int], list[str], str]] = []
        while True:
            if pending:
                name = pending.pop()
                try:
                    child = open_beneath(fd, name, os.O_RDONLY | os.O_DIRECTORY)
                except OSError:
                    yield fd, name, None
                    continue
                above.append((key, pending, name))
                os.close(fd)
                fd = child
                key = _key(os.fstat(fd))
                pending = yield from _listed(fd)
                continue
            if not above:
                return
            key, pending, name = above.pop()
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _key(os.fstat(fd)) != key:
                raise TreeMoved(errno.ESTALE, f"{name} was moved while it was walked")
            yield fd, name, None
    finally:
        os.close(fd)


def _listed(fd: int) -> Generator[tuple[int, str, os.stat_result | None], None, list[str]]:
    """Each entry of the folder ``fd`` with its lstat; returns the names of its subfolders."""
    with os.scandir(fd) as listing:
        entries = list(listing)  # read whole: the consumer may unlink while we yield
    folders = []
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)  # fstatat(fd, name, AT_SYMLINK_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile
        yield fd, entry.name, info
        if stat.S_ISDIR(info.st_mode):
            folders.append(entry.name)
    return folders


def _key(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def remove_contents(folder_fd: int) -> bool:
    """Empty a tenant's folder: files, links (the links themselves) and FIFOs unlinked,
    subfolders removed, nothing outside it touched. True when it is empty at the end."""
    with contextlib.suppress(OSError):  # TreeMoved, or a folder we may not read: what is left stays
        for fd, name, info in walk(folder_fd):
            if info is not None and stat.S_ISDIR(info.st_mode):
                continue  # removed once left (its None item)
            with contextlib.suppress(OSError):
                if info is None:
                    try:
                        os.rmdir(name, dir_fd=fd)
                    except NotADirectoryError:  # swapped for a file or a link meanwhile
                        os.unlink(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
    return not os.listdir(folder_fd)


def remove_tree(parent: str | os.PathLike[str], name: str) -> bool:
    """Remove the tenant's folder ``name`` from ``parent`` (a folder only the agent writes)
    with all it holds, following nothing; True when it is gone (or never was)."""
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        try:
            folder = open_beneath(parent_fd, name, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return True
        except OSError:  # not a folder: a file or a link where the folder was
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent_fd)
            return True
        try:
            remove_contents(folder)
        finally:
            os.close(folder)
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    finally:
        os.close(parent_fd)
