"""The web terminal's WebSocket: the browser's side of ``wire.relay``.

Checked at connect and again every ``STREAM_RECHECK_S`` while it is open
(portal/accounts/streams.py): the user must be allowed to manage the sandbox (its owner, a
manager of its project, an admin) and the sandbox must be a running container or process
sandbox; once that stops being true, the terminal is closed. A socket opened with an API
token (the command-line client's shell: portal/accounts/socket_auth.py) also needs the
token's ``write:sandboxes`` (or ``admin``) scope, as typing into a sandbox changes it, and
has the token's reach (a staff user's token without ``admin``: a member's). A refused connection is
accepted, told why in a ``closed`` message, and closed with 4403 (not allowed) or 4409 (not
possible now). Every opened terminal is recorded in the sandbox's history.

Browser -> server: JSON text ``{"type": "input", "data": "..."}`` or
``{"type": "resize", "rows": R, "cols": C}``. Server -> browser: the pty's bytes as binary
frames, and JSON ``{"type": "opened"}`` / ``{"type": "closed", "reason": "..."}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from channels.db import database_sync_to_async
from django.utils import timezone

from portal.accounts.access import can_manage_sandbox, can_manage_sandbox_by_token, memberships_among
from portal.accounts.models import ApiToken, Membership
from portal.accounts.socket_auth import socket_has_scope, socket_token
from portal.audit import trail
from portal.sandboxes import live
from portal.sandboxes.models import Sandbox, SandboxEvent, SandboxState
from portal.sandboxes.reach import TERMINAL_ISOLATION
from portal.tunnels.tunnel import OPEN_TIMEOUT_S, Tunnel, TunnelClosed, TunnelWebSocket
from wire.relay import StreamBroken
from wire.spec import HandleJson

FORBIDDEN, CONFLICT = 4403, 4409
# What a token must hold to type into a sandbox: the scope that changes sandboxes (or admin).
TOKEN_SCOPE = ApiToken.Scope.WRITE_SANDBOXES


@dataclass(frozen=True)
class Refusal:
    code: int
    reason: str


class SandboxTerminal(TunnelWebSocket):
    # What is opened, in the words of refusals, the sandbox's history and the audit trail
    # (the SSH consumer, portal/tunnels/ssh.py, opens "an SSH connection", its event "ssh").
    what = "a terminal"
    event = "terminal"
    isolation_refusal = "Terminals open into container and process sandboxes; a VM has its console."
    revoked_reason = "The sandbox is no longer running, or you may no longer use its terminal."
    broke_off = "the terminal's output broke off"

    async def connect(self) -> None:
        await self.accept()
        verdict = await database_sync_to_async(self.authorize)(self.scope.get("user"))
        if isinstance(verdict, Refusal):
            await self.send(text_data=json.dumps({"type": "closed", "reason": verdict.reason}))
            await self.close(code=verdict.code)
            return
        host, key, handle = verdict
        self._tunnel = Tunnel()
        await self.open_tunnel(self._tunnel, host, key, handle)
        self.stream(self._from_sandbox(self._tunnel), self._revoked)

    async def open_tunnel(self, tunnel: Tunnel, host: str, key: str, handle: HandleJson | None) -> None:
        await tunnel.open(host, "open_terminal", key, handle)

    def _may_manage(self, user: Any, sandbox: Sandbox) -> bool:
        token = socket_token(self.scope)
        if token is None:
            return can_manage_sandbox(user, sandbox)
        return socket_has_scope(self.scope, TOKEN_SCOPE) and can_manage_sandbox_by_token(
            user, sandbox, token.scopes
        )

    @classmethod
    def still_allowed_all(cls, asks: Sequence[tuple[Self, Any]]) -> list[bool]:
        """Each terminal's sandbox still running and its user still allowed to manage it
        (``_may_manage``'s rules), in two queries for all open terminals."""
        ids = [int(t.scope["url_route"]["kwargs"]["sandbox_id"]) for t, _ in asks]
        running = {
            pk: (owner, project)
            for pk, owner, project in Sandbox.objects.filter(
                pk__in=ids, state=SandboxState.RUNNING
            ).values_list("pk", "owner_id", "project_id")
        }
        managers = memberships_among(
            {user.pk for _, user in asks},
            {project for _, project in running.values()},
            Membership.Role.MANAGER,
        )
        verdicts = []
        for (terminal, user), pk in zip(asks, ids, strict=True):
            token = socket_token(terminal.scope)
            # A staff user's token without the admin scope has a member's reach
            # (can_manage_sandbox_by_token), and without the terminal's scope none.
            as_admin = user.is_staff and (token is None or ApiToken.Scope.ADMIN in token.scopes)
            verdicts.append(
                pk in running
                and socket_has_scope(terminal.scope, TOKEN_SCOPE)
                and (as_admin or running[pk][0] == user.pk or (user.pk, running[pk][1]) in managers)
            )
        return verdicts

    async def _revoked(self) -> None:
        await self.send(text_data=json.dumps({"type": "closed", "reason": self.revoked_reason}))
        await self.close(code=FORBIDDEN)

    def authorize(self, user: Any) -> Refusal | tuple[str, str, dict[str, Any] | None]:
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        sandbox = Sandbox.objects.select_related("host").filter(pk=sandbox_id).first()
        if not socket_has_scope(self.scope, TOKEN_SCOPE):
            return Refusal(FORBIDDEN, f"This API token lacks the scope '{TOKEN_SCOPE}' {self.what} needs.")
        if (
            user is None
            or not user.is_authenticated
            or sandbox is None
            or not self._may_manage(user, sandbox)
        ):
            return Refusal(
                FORBIDDEN,
                f"Only the sandbox's owner, a manager of its project or an admin can open {self.what}.",
            )
        if sandbox.state != SandboxState.RUNNING or sandbox.host is None:
            return Refusal(CONFLICT, f"The sandbox is {sandbox.get_state_display().lower()}, not running.")
        if sandbox.isolation not in TERMINAL_ISOLATION:
            return Refusal(CONFLICT, self.isolation_refusal)
        if sandbox.host.simulated_sandboxes:
            return Refusal(
                CONFLICT, "The sandbox is simulated (its host keeps state only): nothing runs in it."
            )
        if (refusal := self.needs(user)) is not None:
            return refusal
        SandboxEvent.objects.create(
            sandbox=sandbox, at=timezone.now(), from_state=sandbox.state, to_state=sandbox.state,
            actor=user, message=f"{self.event} opened by {user.get_username()}",
        )  # fmt: skip
        live.sandbox_changed(sandbox.pk, sandbox.state)
        if user.pk != sandbox.owner_id:
            trail.record(user, f"sandbox.{self.event}", sandbox, None, None, f"opened {self.what} in it")
        return sandbox.host.name, sandbox.allocation_key, sandbox.handle

    def needs(self, user: Any) -> Refusal | None:
        """What this kind of stream needs of the user beyond the right to the sandbox (the
        SSH consumer: a key); a terminal, nothing."""
        return None

    async def _from_sandbox(self, tunnel: Tunnel) -> None:
        """The pty's output to the browser, piece by piece, until it ends."""
        try:
            await tunnel.wait_opened(OPEN_TIMEOUT_S)
            await self.send(text_data=json.dumps({"type": "opened"}))
            while True:
                await self.send(bytes_data=await tunnel.read())
        except TunnelClosed as closed:
            reason = closed.reason
        except StreamBroken as exc:
            reason = f"{self.broke_off}: {exc}"
        await self.send(text_data=json.dumps({"type": "closed", "reason": reason}))
        await self.close()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self._tunnel is None:
            return
        try:
            message = json.loads(text_data or "{}")
        except json.JSONDecodeError:
            return
        if message.get("type") == "input" and isinstance(message.get("data"), str):
            await self._tunnel.write(message["data"].encode())
        elif message.get("type") == "resize":
            try:
                rows, cols = int(message["rows"]), int(message["cols"])
            except (KeyError, TypeError, ValueError):
                return
            await self._tunnel.resize(max(1, min(rows, 500)), max(1, min(cols, 500)))
