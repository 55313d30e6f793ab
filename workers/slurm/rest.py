"""slurmrestd, through its versioned OpenAPI (``/slurm/v0.0.38/…``, ``/slurmdb/v0.0.38/…``).

Authentication is Slurm's JWT (``auth/jwt``): each request carries a user name and a token
for it. The gateway either mints its own tokens with the cluster's JWT key
(``GPUSHARE_SLURM_JWT_KEY_FILE``: HS256, the claims ``scontrol token`` writes, ``sun`` and
``exp``), renewed before they expire, or is given one (``GPUSHARE_SLURM_TOKEN_FILE``, from
``scontrol token lifespan=…``), which an operator then renews.

What the API refuses is a ``SlurmError`` carrying slurmrestd's own words (its ``errors``
list); an unreachable slurmrestd is a ``SlurmUnreachable``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import requests

from workers.slurm.model import SlurmFormatError, SlurmJob, SlurmNode

API_VERSION = "v0.0.38"  # Slurm 22.05's; 23.02 still serves it (docs/slurm.md)
TOKEN_LIFESPAN_S = 3600
TOKEN_RENEW_BEFORE_S = 300
REQUEST_TIMEOUT_S = 10.0


class SlurmError(RuntimeError):
    """slurmrestd refused or failed a request; the message is its own."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class SlurmUnreachable(SlurmError):
    """slurmrestd did not answer (down, wrong URL): the cluster's state is unknown."""


@dataclass
class MintedTokens:
    """Tokens minted with the cluster's JWT key, as ``scontrol token`` makes them."""

    key: bytes
    lifespan_s: int = TOKEN_LIFESPAN_S

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, float]] = {}

    @classmethod
    def from_file(cls, path: Path) -> MintedTokens:
        return cls(path.read_bytes())

    def token(self, user: str) -> str:
        with self._lock:
            cached = self._tokens.get(user)
            now = time.time()
            if cached is None or cached[1] - now < TOKEN_RENEW_BEFORE_S:
                expires = now + self.lifespan_s
                claims = {"sun": user, "iat": int(now), "exp": int(expires)}
                cached = (jwt.encode(claims, self.key, algorithm="HS256"), expires)
                self._tokens[user] = cached
            return cached[0]


@dataclass(frozen=True)
class GivenToken:
    """One token an operator made (``scontrol token``), for the one user it names."""

    value: str

    def token(self, user: str) -> str:
        return self.value


class SlurmRest:
    """A client of one cluster's slurmrestd, as ``user`` (the gateway's Slurm user: an
    operator, since it lists every job and cancels gpushare's)."""

    def __init__(self, url: str, user: str, tokens: MintedTokens | GivenToken) -> None:
        self.url = url.rstrip("/")
        self.user = user
        self.tokens = tokens
        self._session = requests.Session()
        self._lock = threading.Lock()  # one Session, several threads: requests' is not thread-safe

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": self.tokens.token(self.user)}
        try:
            with self._lock:
                answer = self._session.request(
                    method, f"{self.url}{path}", headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs
                )
        except requests.RequestException as exc:
            raise SlurmUnreachable(f"slurmrestd at {self.url}: {exc}") from exc
        try:
            body: dict[str, Any] = answer.json()
        except ValueError:
            body = {}
        errors = [e for e in body.get("errors") or () if e.get("error_number") or e.get("error_code")]
        if answer.status_code >= 400 or errors:
            said = (
                "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
                or answer.text[:200]
            )
            raise SlurmError(
                f"slurmrestd {method} {path}: HTTP {answer.status_code}: {said}", answer.status_code
            )
        return body

    def ping(self) -> None:
        self._call("GET", f"/slurm/{API_VERSION}/ping")

    def nodes(self) -> list[SlurmNode]:
        return [
            SlurmNode.from_rest(n) for n in self._call("GET", f"/slurm/{API_VERSION}/nodes").get("nodes", ())
        ]

    def jobs(self) -> list[SlurmJob]:
        """Every job slurmctld still knows (pending, running, and recently ended ones)."""
        return [
            SlurmJob.from_rest(j) for j in self._call("GET", f"/slurm/{API_VERSION}/jobs").get("jobs", ())
        ]

    def job(self, job_id: int) -> SlurmJob | None:
        """The job, or None once slurmctld has forgotten it (MinJobAge after its end)."""
        try:
            found = self._call("GET", f"/slurm/{API_VERSION}/job/{job_id}").get("jobs") or ()
        except SlurmError as exc:
            if isinstance(exc, SlurmUnreachable) or "Unable to find JobId" not in str(exc):
                raise
            return None
        return SlurmJob.from_rest(found[0]) if found else None

    def signal(self, job_id: int, signal: str) -> None:
        """Send ``signal`` (SIGTERM, SIGKILL, …) to every step of the job: ``scancel -s``.
        Without a signal slurmrestd cancels the job (``cancel``)."""
        self._call("DELETE", f"/slurm/{API_VERSION}/job/{job_id}", params={"signal": signal})

    def cancel(self, job_id: int) -> None:
        """Cancel the job: its steps get SIGTERM, then SIGKILL after the cluster's KillWait."""
        try:
            self._call("DELETE", f"/slurm/{API_VERSION}/job/{job_id}")
        except SlurmError as exc:  # it ended already
            if isinstance(exc, SlurmUnreachable) or "already completed" not in str(exc).lower():
                raise

    def accounted(self, job_id: int) -> dict[str, Any] | None:
        """slurmdbd's record of a job (elapsed time, TRES), or None when it has none yet."""
        try:
            found = self._call("GET", f"/slurmdb/{API_VERSION}/job/{job_id}").get("jobs") or ()
        except SlurmError as exc:
            if isinstance(exc, SlurmUnreachable):
                raise
            return None
        return found[0] if found else None


__all__ = [
    "API_VERSION",
    "GivenToken",
    "MintedTokens",
    "SlurmError",
    "SlurmFormatError",
    "SlurmRest",
    "SlurmUnreachable",
]
