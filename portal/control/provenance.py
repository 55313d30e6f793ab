"""Whether a message on the control queue is believed: who signed it, and whether that signer
may say what it says.

Every host may push onto the control queue (its Redis user can do nothing else there), so a
message's body proves nothing about where it came from. Each is signed (``wire/signing.py``):
by the control plane (web, beat, this worker's retries), which may send any task; or by one
host's key, or one agent pool's, which may send only the agents' tasks, and only about hosts
it covers. What a message claims is read from its arguments (``CLAIMS``): the hosts it names,
and the hosts that hold the sandboxes it names. A message that fails is dropped before its
handler runs, logged, and raised as a ``forged`` alert (once an hour per signer and task).

A sandbox named by its allocation key is judged by its current placement: a key no sandbox
holds now (a late report from where it ran before) is left to the handler, which ignores it
as it always has. A sandbox named by id alone (storage usage after a stop) is covered if
any of its allocations, past or present, was on a host the signer covers: it may have moved
since.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

from celery import Task
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from django.conf import settings

from portal.fleet import credentials
from portal.fleet.models import Host
from portal.sandboxes.models import Allocation, Sandbox
from portal.telemetry.alerts import do_raise_forgery_alert
from wire import signing

log = logging.getLogger(__name__)

# How long a host's public key is trusted without asking the database again: a revoked or
# rotated key is believed at most this much longer (its Redis user is cut at once anyway).
KEY_CACHE_S = 5.0


@dataclass
class Claims:
    """What a message speaks for."""

    hosts: set[str] = field(default_factory=set)
    allocation_keys: set[str] = field(default_factory=set)
    sandbox_ids: set[int] = field(default_factory=set)


def _hosts(names: Iterable[Any]) -> Claims:
    return Claims(hosts={str(name) for name in names})


# The tasks hosts send (``wire.messages.ControlTasks``, "sent by the agents"), and what each
# claims, from its positional arguments. Every other task is the control plane's alone.
CLAIMS: dict[str, Callable[[list[Any]], Claims]] = {
    "agent_heartbeats": lambda a: _hosts(beat["host"] for beat in a[0]),
    "agent_inventories": lambda a: _hosts(report["host"] for report in a[0]),
    "gpu_faults": lambda a: _hosts([a[0]]),
    "plan_executed": lambda a: _hosts([a[1]]),
    "sandbox_launched": lambda a: Claims(allocation_keys={str(a[0])}),
    "launch_progress": lambda a: Claims(allocation_keys={str(a[0])}),
    "sandbox_launch_failed": lambda a: Claims(allocation_keys={str(a[1])}),
    "sandbox_stopped": lambda a: Claims(allocation_keys={str(a[0])}),
    "sandbox_warned": lambda a: Claims(allocation_keys={str(a[0])}),
    "storage_usage": lambda a: Claims(sandbox_ids={int(a[0])}),
    "sandbox_output": lambda a: Claims(allocation_keys={str(a[0])}),
    "telemetry_host_rollups": lambda a: _hosts(host for host, _ in a[0]),
    "telemetry_alerts": lambda a: _hosts([a[0]]),
    "sandbox_over_share": lambda a: Claims(hosts={str(a[0])}, allocation_keys={str(a[1]["allocation_key"])}),
    "slurm_accounted": lambda a: Claims(allocation_keys={str(a[0])}),
}


@cache
def _control_key() -> Ed25519PublicKey:
    return signing.control_private_key(settings.SECRET_KEY).public_key()


_host_keys: dict[str, tuple[float, Ed25519PublicKey | None]] = {}


def key_of(signer: str) -> Ed25519PublicKey | None:
    """The public key ``signer`` is believed with now; None: not one we know (or revoked)."""
    if signer == signing.CONTROL:
        return _control_key()
    now = time.monotonic()
    cached = _host_keys.get(signer)
    if cached is not None and now - cached[0] < KEY_CACHE_S:
        return cached[1]
    text = credentials.public_key_of(signer)
    try:
        key = signing.public_key(text) if text else None
    except signing.KeyFormatError:
        log.error("%s's stored public key is malformed; its messages are refused", signer)
        key = None
    _host_keys[signer] = (now, key)
    return key


def forget_keys() -> None:
    """Ask the database again for every key (tests; a rotation that must count at once)."""
    _host_keys.clear()


def admit(name: str, task: Task[Any, Any], args: tuple[Any, ...] | list[Any]) -> bool:
    """Whether the control worker runs this message of task ``name`` (``workers.control.<name>``).
    A message run in-process (called directly, or eagerly by a test) came from no queue."""
    request = task.request
    if request.called_directly or request.is_eager:
        return True
    args = list(args)
    headers = signing.message_headers(task)
    try:
        signer = signing.verify(headers, task.name, request.id or "", args, request.kwargs or {}, key_of)
    except signing.SigningError as exc:
        claimed = _claimed_quietly(name, args)
        _refuse(name, str(headers.get(signing.SIGNER_HEADER) or "?"), claimed, str(exc))
        return False
    if signer == signing.CONTROL:
        return True
    claims = CLAIMS.get(name)
    if claims is None:
        _refuse(name, signer, set(), f"{name} is the control plane's to send, not a host's")
        return False
    try:
        wanted = _hosts_claimed(claims(args))
    except (LookupError, TypeError, ValueError, AttributeError) as exc:
        _refuse(name, signer, set(), f"its arguments are malformed ({type(exc).__name__})")
        return False
    strangers = set().union(*(hosts for hosts in wanted if not any(signing.covers(signer, h) for h in hosts)))
    if strangers:
        _refuse(name, signer, strangers, f"speaks for {', '.join(sorted(strangers)[:5])}")
        return False
    return True


def _hosts_claimed(claims: Claims) -> list[set[str]]:
    """What a message speaks for, as sets of hosts of which the signer must cover one: each
    host it names; the host holding each sandbox it names by allocation key; for a sandbox
    named by id, every host it was ever on (see the module's docstring)."""
    wanted = [{host} for host in claims.hosts]
    if claims.allocation_keys:
        placed = Sandbox.objects.filter(allocation_key__in=claims.allocation_keys, host__isnull=False)
        wanted += [{host} for host in placed.values_list("host__name", flat=True)]
    for sandbox_id in claims.sandbox_ids:
        held_on = Allocation.objects.filter(sandbox_id=sandbox_id).values_list("gpu__host__name", flat=True)
        wanted.append(set(held_on) or {f"(sandbox {sandbox_id}, never placed)"})
    return wanted


def _claimed_quietly(name: str, args: list[Any]) -> set[str]:
    """What an unverified message claimed, for the alert's host; nothing if unreadable."""
    claims = CLAIMS.get(name)
    if claims is None:
        return set()
    try:
        return set().union(*_hosts_claimed(claims(args)))
    except (LookupError, TypeError, ValueError, AttributeError):
        return set()


def _printable(text: str, limit: int = 80) -> str:
    """A sender's own words (its claimed signer), safe for a log line and an alert."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _refuse(name: str, signer: str, claimed: set[str], why: str) -> None:
    signer = _printable(signer)
    message = f"{name} from {signer} dropped: {_printable(why, 200)}"
    log.warning("forged message: %s", message)
    # The host whose key signed it, if that is a host; else one it claimed to be.
    kind, _, own = signer.partition(":")
    host = Host.objects.filter(name=own).first() if kind == "host" else None
    if host is None and claimed:
        host = Host.objects.filter(name__in=claimed).order_by("name").first()
    if host is None:
        return  # no host to attach it to: the log line is all there is
    # Keyed by the host it is attached to, not the signer it claimed: a sender making up new
    # signers raises no more alerts than one that keeps to one.
    hour = datetime.now(tz=UTC).strftime("%Y%m%d%H")
    do_raise_forgery_alert(host, f"forged:{host.name}:{name}:{hour}", message)
