"""The public keys an SSH connection into a sandbox may log in with, as they cross from the
portal to a host's agent (``AgentTasks.open_ssh``).

The portal checks a key whole when its owner adds it (``portal/accounts/ssh_keys.py``: the
blob decoded, its type and size); the agent checks again that each line is one bare key of
these types, so that nothing but keys reaches the ``authorized_keys`` file of the sandbox's
sshd: a forged or corrupted message cannot add ``command=`` or other options to a line, nor
a second line, nor a comment.
"""

from __future__ import annotations

import re

# What OpenSSH's authorized_keys takes and gpushare accepts: no DSA (OpenSSH 9.8 dropped it),
# no certificates (gpushare is no CA). The sk- types are FIDO security keys.
KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
# A key's blob in base64 is some 70 (ed25519) to 1,100 (RSA 8192) characters.
MAX_BLOB_CHARS = 4096
# How many keys one connection offers at most: every key of the connecting user.
MAX_KEYS = 100
_TYPES = "|".join(re.escape(t) for t in KEY_TYPES)
_LINE = re.compile(rf"(?P<type>{_TYPES}) (?P<blob>[A-Za-z0-9+/]{{16,{MAX_BLOB_CHARS}}}={{0,2}})")


def bare_key(line: str) -> str | None:
    """``line`` when it is exactly ``<type> <base64 blob>`` of a type above; else None."""
    return line if _LINE.fullmatch(line) else None
