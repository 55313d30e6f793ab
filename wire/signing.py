"""Signed task messages: who sent a message, proven with an Ed25519 signature.

Per-host Redis users (``wire.broker_acl``) keep a host from reading what is not its own, but
every host may push onto the control queue, and a message's body says which host it is
about. So every task message carries two headers: its signer (``control``, ``host:<name>``
or ``pool:<prefix>``) and a signature over the task's name, id, arguments and that signer.
The control worker checks a host's messages against the key it was enrolled with and what
they claim against the hosts that key covers (``portal.control.provenance``); an agent runs
only what the control plane signed (``control_only``). Every task of the app, Celery's own
included, is checked (``SignedTask``).

Keys:
- a host's (or an agent pool's) is made when it is enrolled (``manage.py host_credential``);
  the control plane keeps only its public half, the agent loads the private half from
  ``GPUSHARE_HOST_KEY`` / ``GPUSHARE_HOST_KEY_FILE`` (a systemd credential in deployment);
- the control plane's (web, control worker, beat) is derived from ``SECRET_KEY`` with HKDF,
  so every control-plane process holds it with no key of its own to distribute; agents get
  its public half (``GPUSHARE_CONTROL_PUBLIC_KEY``), which enrolment writes out with theirs.

Keys travel as text: ``ed25519:`` and the 32 raw bytes in base64.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from kombu.utils import json as kombu_json

log = logging.getLogger(__name__)

SIGNER_HEADER = "gpushare_signer"
SIGNATURE_HEADER = "gpushare_sig"
CONTROL = "control"
KEY_PREFIX = "ed25519:"


class SigningError(Exception):
    """A message that is not signed, or not by whom it says: said for the log and the alert."""


class KeyFormatError(ValueError):
    """A key's text that is not one of ours."""


def _encode(raw: bytes) -> str:
    return KEY_PREFIX + base64.b64encode(raw).decode()


def _decode(text: str, what: str) -> bytes:
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise KeyFormatError(f"{what} must start with {KEY_PREFIX!r}")
    try:
        raw = base64.b64decode(text.removeprefix(KEY_PREFIX), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyFormatError(f"{what} is not base64") from exc
    if len(raw) != 32:
        raise KeyFormatError(f"{what} must hold 32 bytes, not {len(raw)}")
    return raw


def new_private_key() -> str:
    """A fresh private key, as text."""
    return _encode(Ed25519PrivateKey.generate().private_bytes_raw())


def private_key(text: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_decode(text, "a private key"))


def public_key(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_decode(text, "a public key"))


def public_text(key: Ed25519PrivateKey) -> str:
    return _encode(key.public_key().public_bytes_raw())


def control_private_key(secret_key: str) -> Ed25519PrivateKey:
    """The control plane's key, the same in every process that holds ``secret_key``."""
    seed = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"gpushare", info=b"control-plane message signing v1"
    ).derive(secret_key.encode())
    return Ed25519PrivateKey.from_private_bytes(seed)


def host_signer(host: str) -> str:
    return f"host:{host}"


def pool_signer(prefix: str) -> str:
    return f"pool:{prefix}"


def covers(signer: str, host: str) -> bool:
    """Whether ``signer`` may speak for ``host``: its own host, or any host of its pool."""
    kind, _, name = signer.partition(":")
    if kind == "host":
        return host == name
    if kind == "pool":
        return bool(name) and host.startswith(name)
    return False


def _payload(task: str, task_id: str, signer: str, args: Any, kwargs: Any) -> bytes:
    """What is signed: the same bytes from the sender's arguments and from the receiver's
    decoded ones (sorted keys, no spaces; tuples travel as lists, as kombu's JSON sends them)."""
    body = [task, task_id, signer, list(args or ()), dict(kwargs or {})]
    return kombu_json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Signer:
    name: str
    key: Ed25519PrivateKey

    def headers(self, task: str, task_id: str, args: Any, kwargs: Any) -> dict[str, str]:
        signature = self.key.sign(_payload(task, task_id, self.name, args, kwargs))
        return {SIGNER_HEADER: self.name, SIGNATURE_HEADER: base64.b64encode(signature).decode()}


def verify(
    headers: Mapping[str, Any],
    task: str,
    task_id: str,
    args: Any,
    kwargs: Any,
    key_of: Callable[[str], Ed25519PublicKey | None],
) -> str:
    """The message's signer, once its signature checks out against ``key_of(signer)``;
    SigningError otherwise (no signer, no key for it, a bad signature)."""
    signer, signature = headers.get(SIGNER_HEADER), headers.get(SIGNATURE_HEADER)
    if not isinstance(signer, str) or not isinstance(signature, str):
        raise SigningError("unsigned")
    key = key_of(signer)
    if key is None:
        raise SigningError(f"signed by {signer}, which has no active key")
    try:
        key.verify(base64.b64decode(signature, validate=True), _payload(task, task_id, signer, args, kwargs))
    except (InvalidSignature, binascii.Error, ValueError) as exc:
        raise SigningError(f"claims to be signed by {signer}, and its signature does not verify") from exc
    return signer


# The signer this process's messages go out with (``wire.celery`` installs it); a tool or a
# test may sign as another for a while (``signing_as``).
_process_signer: Callable[[], Signer] | None = None
_override: contextvars.ContextVar[Signer | None] = contextvars.ContextVar("gpushare_signer", default=None)


def install(signer: Callable[[], Signer]) -> None:
    global _process_signer
    _process_signer = signer


def current() -> Signer:
    override = _override.get()
    if override is not None:
        return override
    if _process_signer is None:
        raise SigningError("this process has no signer installed (wire.celery installs one)")
    return _process_signer()


@contextlib.contextmanager
def signing_as(signer: Signer) -> Iterator[None]:
    """Messages sent in this block go out signed by ``signer`` (another host's tests, tools)."""
    token = _override.set(signer)
    try:
        yield
    finally:
        _override.reset(token)


def message_headers(task: Task[Any, Any]) -> dict[str, Any]:
    """The headers a running task's message came with (Celery keeps those it does not know
    in ``request.headers``, or as attributes of the request)."""
    request = task.request
    headers = dict(getattr(request, "headers", None) or {})
    for name in (SIGNER_HEADER, SIGNATURE_HEADER):
        value = getattr(request, name, None)
        if name not in headers and value is not None:
            headers[name] = value
    return headers


# What this worker believes (``install_verifier``): the control worker's judges signer and
# claims (portal.control.provenance), an agent's believes the control plane alone.
Verifier = Callable[[Task[Any, Any], tuple[Any, ...], dict[str, Any]], bool]
_verifier: Verifier | None = None


def install_verifier(verifier: Verifier | None) -> None:
    global _verifier
    _verifier = verifier


def control_only(key: Ed25519PublicKey) -> Verifier:
    """An agent's: a message runs only if the control plane signed it; another sender (a host
    pushing onto a queue it should not reach, a message altered on the way) is logged."""

    def believed(task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            verify(
                message_headers(task),
                task.name,
                task.request.id or "",
                args,
                kwargs,
                lambda signer: key if signer == CONTROL else None,
            )
        except SigningError as exc:
            log.error("%s %s dropped: %s", task.name, task.request.id, exc)
            return False
        return True

    return believed


class SignedTask(Task[Any, Any]):
    """The base of every task of the app (``wire.celery``'s ``task_cls``), Celery's own
    canvas tasks (``celery.map``, ``celery.chain``…) included: those run other tasks in
    process, so a check on ours alone could be walked around by a message naming one of them.
    A message runs only if this worker's verifier believes it; one it does not is dropped,
    acknowledged so that it is not delivered again. A task called in process (by a task that
    was believed, or by a test) or eagerly came from no queue and is not judged."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Celery's tracer calls a task with its own __call__ in place of run, the request
        # already pushed: run is called here, not Task.__call__ (which would push another).
        request = self.request
        if not (request.called_directly or request.is_eager):
            if _verifier is None:
                log.error("%s %s dropped: this worker has no verifier installed", self.name, request.id)
                return None
            if not _verifier(self, args, kwargs):
                return None
        return self.run(*args, **kwargs)
