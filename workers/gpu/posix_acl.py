"""One named user's entry in a directory's POSIX access ACL, written as the kernel's
``system.posix_acl_access`` extended attribute (the format of linux/posix_acl_xattr.h, acl(5)).

Why the MPS pipe directory needs it: NVIDIA's MPS control daemon starts a client uid's server
with that uid alone. Seen on an H200 (driver 580.159): the server ran as the GPU's MPS uid with
gid 0 and no supplementary groups, so a pipe directory that the MPS *group* may write was closed
to it; it exited at once, restarted in a loop, and every client failed with error 805. A named
user entry grants the uid itself, and the directory stays root's, so its sticky bit still keeps
root's control socket from the tenants. (pylibacl, the library for this, ships no wheels: it
would need libacl's headers on every GPU host, for one attribute of twenty-odd bytes.)
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_RWX = 0o7
_ENTRY = struct.Struct("<HHI")  # tag, permissions, id


def grant_user(path: Path, uid: int) -> None:
    """Give ``uid`` read, write and search on the directory ``path``, beside its mode's owner,
    group and other bits (the mask rwx; entries must be sorted by tag, as here). Replaces any
    named entries already there. OSError (EOPNOTSUPP) where the file system has no ACLs."""
    mode = os.stat(path, follow_symlinks=False).st_mode
    entries = [
        (_USER_OBJ, (mode >> 6) & _RWX, _NO_ID),
        (_USER, _RWX, uid),
        (_GROUP_OBJ, (mode >> 3) & _RWX, _NO_ID),
        (_MASK, _RWX, _NO_ID),
        (_OTHER, mode & _RWX, _NO_ID),
    ]
    value = struct.pack("<I", _VERSION) + b"".join(_ENTRY.pack(*entry) for entry in entries)
    os.setxattr(path, XATTR, value, follow_symlinks=False)


def named_users(path: Path) -> dict[int, int]:
    """The named user entries of ``path``'s access ACL: uid -> permission bits (none: {})."""
    try:
        value = os.getxattr(path, XATTR, follow_symlinks=False)
    except OSError:
        return {}
    body = value[struct.calcsize("<I") :]
    return {
        ident: perms
        for tag, perms, ident in (_ENTRY.unpack_from(body, at) for at in range(0, len(body), _ENTRY.size))
        if tag == _USER
    }
