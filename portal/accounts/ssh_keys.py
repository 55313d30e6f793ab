"""SSH public keys on a user's account, self-service: added, listed and removed here (the
account's SSH keys page and ``/api/v1/ssh-keys/``); adding and removing are audited.

``parse_public_key`` checks a key whole, as OpenSSH would read it: one line of ``<type>
<base64> [comment]`` (an ``authorized_keys`` line with options is refused: the portal
writes the lines), its blob decoded and read field by field, its type one of
``wire.ssh.KEY_TYPES``, an RSA key of at least ``MIN_RSA_BITS``. What is stored and handed
to sandboxes is the bare ``<type> <base64>``; the comment is the default name.
``offered_keys`` gives an SSH connection its user's keys (portal/tunnels/ssh.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.accounts.models import SshKey
from portal.api.text import text_problem
from portal.audit import trail
from wire.ssh import KEY_TYPES, MAX_BLOB_CHARS, MAX_KEYS, bare_key

MIN_RSA_BITS = 3072  # NIST's floor past 2030; OpenSSH's ssh-keygen makes 3072 by default
_ECDSA_POINT_BYTES = {"nistp256": 65, "nistp384": 97, "nistp521": 133}  # uncompressed: 04 || X || Y
_ECDSA_BITS = {"nistp256": 256, "nistp384": 384, "nistp521": 521}
MAX_NAME = 100


class SshKeyError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PublicKey:
    bare: str  # "<type> <base64>"
    comment: str
    fingerprint: str  # "SHA256:<base64 without padding>"
    bits: int


class _Blob:
    """The wire format of a public key (RFC 4253 6.6): strings and mpints, each behind its
    four-byte length."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def string(self) -> bytes:
        if self.at + 4 > len(self.data):
            raise SshKeyError("public_key", "The key is cut short: paste the whole line of the .pub file.")
        (length,) = struct.unpack(">I", self.data[self.at : self.at + 4])
        start, self.at = self.at + 4, self.at + 4 + length
        if self.at > len(self.data):
            raise SshKeyError("public_key", "The key is cut short: paste the whole line of the .pub file.")
        return self.data[start : self.at]

    def end(self) -> None:
        if self.at != len(self.data):
            raise SshKeyError("public_key", "The key has bytes after its end: it is not a public key.")


def _key_bits(key_type: str, blob: _Blob) -> int:
    """The key's size in bits, after reading the fields its type has."""
    if key_type in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(blob.string()) != 32:
            raise SshKeyError("public_key", "An Ed25519 key is 32 bytes: this one is not.")
        bits = 256
    elif key_type == "ssh-rsa":
        exponent, modulus = blob.string(), blob.string()
        if not exponent or not modulus:
            raise SshKeyError("public_key", "The RSA key has no exponent or modulus.")
        bits = int.from_bytes(modulus, "big").bit_length()
        if bits < MIN_RSA_BITS:
            raise SshKeyError(
                "public_key",
                f"This RSA key has {bits} bits: use {MIN_RSA_BITS} or more, or better an Ed25519 key "
                "(ssh-keygen -t ed25519).",
            )
    else:  # ECDSA: the curve is named in the type and again in the blob
        # ecdsa-sha2-nistp256, sk-ecdsa-sha2-nistp256@openssh.com: the third word, sans sk-/@.
        curve = key_type.removeprefix("sk-").split("-")[2].split("@")[0]
        # .get, not []: a type or blob naming a curve of no table is the user's error, not a 500.
        if blob.string() != curve.encode() or len(blob.string()) != _ECDSA_POINT_BYTES.get(curve):
            raise SshKeyError("public_key", f"The key's curve or point does not match {key_type}.")
        bits = _ECDSA_BITS[curve]
    if key_type.startswith("sk-"):
        blob.string()  # the security key's application, e.g. "ssh:"
    blob.end()
    return bits


def parse_public_key(text: str) -> PublicKey:
    """``text`` (a .pub file's line) checked whole; SshKeyError naming what is wrong."""
    line = text.strip()
    if not line:
        raise SshKeyError("public_key", "Paste your public key: the line of ~/.ssh/id_ed25519.pub, say.")
    if "\n" in line or "\r" in line:
        raise SshKeyError("public_key", "Paste one key, on one line.")
    if line.startswith("-----BEGIN") or "PRIVATE KEY" in line:
        raise SshKeyError("public_key", "This is a private key: paste the public one (the .pub file), and "
                          "keep this one to yourself.")  # fmt: skip
    key_type, _, rest = line.partition(" ")
    encoded, _, comment = rest.strip().partition(" ")
    if key_type not in KEY_TYPES:
        raise SshKeyError(
            "public_key",
            "Not a public key of a supported type (options before the key are not taken either). "
            f"Supported: {', '.join(KEY_TYPES)}.",
        )
    if len(encoded) > MAX_BLOB_CHARS:
        raise SshKeyError("public_key", "The key is longer than any supported key.")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SshKeyError("public_key", "The key's base64 part does not decode.") from exc
    blob = _Blob(raw)
    if blob.string() != key_type.encode():
        raise SshKeyError("public_key", f"The key says it is {key_type} but its contents are another type.")
    bits = _key_bits(key_type, blob)
    bare = f"{key_type} {base64.b64encode(raw).decode()}"
    if bare_key(bare) is None:
        raise SshKeyError("public_key", "The key is not one the sandboxes' sshd could be given.")
    fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
    return PublicKey(bare, comment.strip(), fingerprint, bits)


def check_add_key(user: Any, name: str, public_key: str) -> tuple[PublicKey, str]:
    """The key and the name it will have (the key's comment when none is given)."""
    key = parse_public_key(public_key)
    name = name.strip() or key.comment[:MAX_NAME] or key.fingerprint[:MAX_NAME]
    if problem := text_problem(name, max_length=MAX_NAME):
        raise SshKeyError("name", problem)
    if SshKey.objects.filter(user=user).count() >= MAX_KEYS:
        raise SshKeyError("public_key", f"You have {MAX_KEYS} SSH keys: remove one first.")
    if SshKey.objects.filter(user=user, fingerprint=key.fingerprint).exists():
        raise SshKeyError("public_key", "This key is already on your account.")
    return key, name


def do_add_key(user: Any, name: str, public_key: str) -> SshKey:
    key, name = check_add_key(user, name, public_key)
    try:
        with transaction.atomic():
            row = SshKey.objects.create(
                user=user, name=name, public_key=key.bare, fingerprint=key.fingerprint
            )
            trail.record(
                user, "ssh_key.added", row, None, {"name": name, "fingerprint": key.fingerprint},
                f"{user.get_username()} added SSH key {key.fingerprint}",
            )  # fmt: skip
    except IntegrityError as exc:  # the same key added twice at once
        raise SshKeyError("public_key", "This key is already on your account.") from exc
    return row


def do_remove_key(user: Any, key_id: int) -> SshKey | None:
    """Remove one of ``user``'s own keys (None when there is none such: a 404). A connection
    already open stays open: the key was given to its sshd when it opened."""
    with transaction.atomic():
        row = SshKey.objects.select_for_update().filter(user=user, pk=key_id).first()
        if row is None:
            return None
        trail.record(
            user, "ssh_key.removed", row, {"name": row.name, "fingerprint": row.fingerprint}, None,
            f"{user.get_username()} removed SSH key {row.fingerprint}",
        )  # fmt: skip
        row.delete()
    return row


def offered_keys(user: Any) -> list[str]:
    """Every key of ``user``'s, for one SSH connection of theirs; each marked offered now."""
    rows = list(SshKey.objects.filter(user=user).values_list("pk", "public_key"))
    if rows:
        SshKey.objects.filter(pk__in=[pk for pk, _ in rows]).update(last_offered_at=timezone.now())
    return [key for _, key in rows]
