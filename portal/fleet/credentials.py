"""Enrolment: each GPU host's own Redis user and signing key, issued, rotated and revoked by
the control plane.

``issue`` creates the host's user with its ACL (``wire.broker_acl``) and a fresh password, and
a fresh key pair its agent signs its messages with (``wire.signing``); it returns what the
agent needs (``Enrolment``): the broker URL, the private key, and the control plane's public
key. They are shown that once; only the password's hash and the key's public half are kept.
``revoke`` deletes the user and cuts the connections it holds, and its key verifies nothing
more: the agent can no longer fetch work or report, so the host goes quiet and is marked lost
within the lost-host bound. ``rotate`` replaces the password and the key (the old password's
connections are cut). ``reconcile``
applies what the database says to Redis again, for a Redis that restarted without its ACL
file; the control worker runs it at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.utils import timezone

from portal.fleet.models import HostCredential
from wire import broker_acl, signing

log = logging.getLogger(__name__)


class CredentialError(Exception):
    """An enrolment that cannot be done, said for the operator."""


def control_public_key() -> str:
    """The control plane's public key, which agents check its messages against."""
    return signing.public_text(signing.control_private_key(settings.SECRET_KEY))


@dataclass(frozen=True)
class Enrolment:
    """What one agent (or agent pool) is given, once: its broker URL and private key (secrets),
    and the control plane's public key."""

    host: str
    redis_url: str
    host_key: str
    control_public_key: str

    # File names as the agent's systemd unit loads them (LoadCredential=<name>:<dir>/<name>).
    FILES = ("redis_url", "host_key", "control_key.pub")

    def env(self) -> dict[str, str]:
        """The agent's environment, for a process started beside the control plane (``make
        run``, tests); a deployed host reads the files ``write`` makes."""
        return {
            "REDIS_URL": self.redis_url,
            "GPUSHARE_HOST_KEY": self.host_key,
            "GPUSHARE_CONTROL_PUBLIC_KEY": self.control_public_key,
        }

    def files(self) -> list[tuple[str, str]]:
        """(file name, content) of each part, as ``write`` writes them and the console shows them."""
        return list(zip(self.FILES, (self.redis_url, self.host_key, self.control_public_key), strict=True))

    def write(self, directory: Path) -> list[Path]:
        """Each part to its own file in ``directory`` (made 0700; files 0600, never through a
        link someone left there)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        written = []
        for name, value in self.files():
            path = directory / name
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a fresh file: no old mode, no link followed
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "w") as sink:
                sink.write(value + "\n")
            written.append(path)
        return written


def _enrolment(credential: HostCredential, password: str, key: str) -> Enrolment:
    return Enrolment(
        host=credential.host,
        redis_url=agent_url(settings.REDIS_URL, credential.username, password),
        host_key=key,
        control_public_key=control_public_key(),
    )


def public_key_of(signer: str) -> str | None:
    """The public key an active credential's agent signs with, for ``signer`` as
    ``wire.signing`` names it (``host:<name>``, ``pool:<prefix>``); None for none."""
    kind, _, name = signer.partition(":")
    if kind not in ("host", "pool") or not name:
        return None
    key = (
        HostCredential.objects.filter(host=name, pool=kind == "pool", revoked_at__isnull=True)
        .values_list("signing_key", flat=True)
        .first()
    )
    return key or None


def _admin() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def agent_url(base_url: str, username: str, password: str) -> str:
    """The control plane's broker URL with a host's (or pool's) user and password in it."""
    user = quote(username, safe="")
    secret = quote(password, safe="")
    parts = urlsplit(base_url)
    if parts.scheme == "unix":
        # unix://user:password@/path: what redis-py and kombu's redis+socket:// both read.
        return urlunsplit(("unix", f"{user}:{secret}@", parts.path, parts.query, ""))
    if parts.scheme not in ("redis", "rediss"):
        raise CredentialError(f"REDIS_URL's scheme {parts.scheme!r} is not redis, rediss or unix")
    netloc = f"{user}:{secret}@{parts.hostname or '127.0.0.1'}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def _apply(client: Any, credential: HostCredential, selectors: bool | None = None) -> None:
    """``selectors``: whether the server has them, when the caller asked already."""
    if selectors is None:
        selectors = broker_acl.supports_selectors(client)
    rules = (broker_acl.pool_rules if credential.pool else broker_acl.agent_rules)(
        credential.host, credential.password_sha256, selectors
    )
    client.execute_command("ACL", "SETUSER", credential.username, *rules)


def _cut(client: Any, credential: HostCredential) -> None:
    """Close every connection the user holds (Redis keeps them open across a change)."""
    client.execute_command("CLIENT", "KILL", "USER", credential.username)


def _check_host(host: str) -> None:
    """What ``Host.name`` takes (a slug of at most 63): no glob character widens the ACL's patterns."""
    try:
        validate_slug(host)
    except ValidationError:
        pass
    else:
        if len(host) <= 63:
            return
    raise CredentialError(f"{host!r} is not a host name (1-63 letters, digits, '-' or '_')")


def issue(host: str, pool: bool = False) -> Enrolment:
    """A credential for a host that has none active: what its agent needs. With ``pool``,
    ``host`` is an agent pool's prefix: every host of its file starts with it."""
    _check_host(host)
    if HostCredential.objects.filter(host=host, revoked_at__isnull=True).exists():
        raise CredentialError(f"{host} already has a credential: rotate it, or revoke it first")
    password, key = secrets.token_urlsafe(32), signing.new_private_key()
    with transaction.atomic():
        credential, _ = HostCredential.objects.update_or_create(
            host=host,
            defaults={
                "pool": pool,
                "password_sha256": broker_acl.password_hash(password),
                "signing_key": signing.public_text(signing.private_key(key)),
                "issued_at": timezone.now(),
                "rotated_at": None,
                "revoked_at": None,
            },
        )
        _apply(_admin(), credential)
    log.info("issued a credential to %s %s", "agent pool" if pool else "host", host)
    return _enrolment(credential, password, key)


def rotate(host: str) -> Enrolment:
    """A new password and key for an active credential; connections made with the old password
    are cut, and messages signed with the old key are no longer believed."""
    password, key = secrets.token_urlsafe(32), signing.new_private_key()
    with transaction.atomic():
        credential = _active(host)
        credential.password_sha256 = broker_acl.password_hash(password)
        credential.signing_key = signing.public_text(signing.private_key(key))
        credential.rotated_at = timezone.now()
        credential.save(update_fields=["password_sha256", "signing_key", "rotated_at"])
        client = _admin()
        _apply(client, credential)
        _cut(client, credential)
    log.info("rotated %s's credential", host)
    return _enrolment(credential, password, key)


def renew(host: str, pool: bool = False) -> Enrolment:
    """Issue, or rotate the active one: for what enrols on every start (``make run``, the twin)."""
    if HostCredential.objects.filter(host=host, pool=pool, revoked_at__isnull=True).exists():
        return rotate(host)
    return issue(host, pool)


def revoke(host: str) -> None:
    """The host's user is deleted and its connections cut."""
    with transaction.atomic():
        credential = _active(host)
        credential.revoked_at = timezone.now()
        credential.save(update_fields=["revoked_at"])
        # Deleting a user closes the connections made with it (Redis 7 and 6.2 alike).
        _admin().execute_command("ACL", "DELUSER", credential.username)
    log.warning("revoked %s's credential: its agent is cut off, and its key verifies nothing", host)


def reconcile() -> int:
    """Redis's host users made to match the database: active ones (re)applied, revoked ones
    deleted (users this database does not know are left alone: ACL users belong to the whole
    Redis server, which another deployment may share). The number of users applied."""
    client = _admin()
    selectors = broker_acl.supports_selectors(client)  # one INFO for all of them
    applied = 0
    for credential in HostCredential.objects.all():
        if credential.active:
            _apply(client, credential, selectors)
            applied += 1
        else:
            client.execute_command("ACL", "DELUSER", credential.username)
    return applied


def _active(host: str) -> HostCredential:
    credential = HostCredential.objects.select_for_update().filter(host=host, revoked_at__isnull=True).first()
    if credential is None:
        raise CredentialError(f"{host} has no active credential (issue one)")
    return credential
