"""What a run of ``gpushare`` ended with: its exit code says what happened, so that a script
can tell a refused request from a lost network (``gpushare --help`` lists them)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    OK = 0
    ERROR = 1  # unexpected: a fault of the client, or a file it cannot read or write
    USAGE = 2  # bad arguments (argparse's own code)
    REFUSED = 3  # the portal refused the request (400, 403, 409, 422): the reason names the field
    AUTH = 4  # not signed in, or the token is invalid, revoked or expired (401)
    NOT_FOUND = 5  # no such sandbox or invoice among your projects (404)
    SANDBOX_ENDED = 6  # the sandbox failed or ended while being waited for
    TIMED_OUT = 7  # --timeout passed before the sandbox ran
    UNREACHABLE = 8  # the portal could not be reached, or failed (5xx, not the gpushare API)
    RATE_LIMITED = 9  # too many requests (429): retry after the time it names
    INTERRUPTED = 130  # Ctrl-C


EXIT_HELP = """\
exit codes:
  0    done
  1    unexpected error in the client
  2    bad arguments
  3    refused by the portal (the reason names the field at fault)
  4    not signed in, or the token is invalid, revoked or expired
  5    no such sandbox or invoice among your projects
  6    the sandbox failed or ended while waiting for it
  7    timed out waiting (--timeout)
  8    portal unreachable or failing
  9    rate limited: try again later
  130  interrupted (Ctrl-C)
  gpushare shell -c CMD, or with a script piped in, ends with the command's own status."""


class ClientError(Exception):
    """An expected failure: printed as one line (no traceback), and in ``--json`` mode also
    as ``{"error": ...}`` on stdout, merged with ``document`` (what was known by then)."""

    def __init__(
        self,
        code: Exit,
        message: str,
        *,
        fields: dict[str, list[str]] | None = None,
        document: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields or {}
        self.document = document or {}

    def as_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "exit": int(self.code),
            "kind": self.code.name.lower(),
            "message": self.message,
        }
        if self.fields:
            error["fields"] = self.fields
        return {**self.document, "error": error}
