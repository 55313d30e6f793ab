"""SSH into a sandbox through the portal: the WebSocket ``gpushare ssh-proxy`` (an OpenSSH
``ProxyCommand``) opens, whose binary frames are the SSH connection's bytes both ways.

The host's agent runs ``sshd -i`` inside the sandbox as its user for this connection alone
(workers/drivers/sshd.py) and relays its stdin and stdout (``wire/relay.py``), so no port
is opened on any host: SSH, scp, rsync, ``ssh -L`` and VS Code's Remote-SSH all ride this
one socket. Two locks: the socket is the terminal's (portal/tunnels/consumers.py: the API
token with ``write:sandboxes``, or the session; the sandbox's owner, a manager of its
project or an admin; checked at connect and every ``STREAM_RECHECK_S``; refused and closed
with its codes and messages; each opening in the sandbox's history as "ssh opened by X");
then sshd lets in only the keys on the connecting user's account (``SshKey``), given to it
for this connection: a manager connecting to a member's sandbox logs in with the
manager's keys, never the member's.

Client -> server: binary frames, the SSH client's bytes. Server -> client: binary frames,
sshd's bytes, and JSON text ``{"type": "opened"}`` / ``{"type": "closed", "reason": "..."}``
as the terminal's.
"""

from __future__ import annotations

import json
from typing import Any

from portal.accounts.ssh_keys import offered_keys
from portal.tunnels.consumers import CONFLICT, Refusal, SandboxTerminal
from portal.tunnels.tunnel import Tunnel, TunnelClosed
from wire.spec import HandleJson

NO_KEY = (
    "You have no SSH key on your account: add one on the portal's SSH keys page (/account/ssh-keys/), "
    "or run gpushare ssh-config --write, which makes one and adds it."
)


class SandboxSsh(SandboxTerminal):
    what = "an SSH connection"
    event = "ssh"
    isolation_refusal = "SSH reaches container and process sandboxes; a VM has its console."
    revoked_reason = "The sandbox is no longer running, or you may no longer reach it over SSH."
    broke_off = "the SSH connection broke off"
    _keys: list[str]

    async def open_tunnel(self, tunnel: Tunnel, host: str, key: str, handle: HandleJson | None) -> None:
        await tunnel.open(host, "open_ssh", key, handle, self._keys)

    def needs(self, user: Any) -> Refusal | None:
        self._keys = offered_keys(user)
        return None if self._keys else Refusal(CONFLICT, NO_KEY)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self._tunnel is None or not bytes_data:
            return  # text frames carry nothing up: the client's bytes are binary
        try:
            await self._tunnel.write(bytes_data)
        except TunnelClosed as closed:  # the relay's Redis failed: the connection cannot go on
            await self.send(text_data=json.dumps({"type": "closed", "reason": closed.reason}))
            await self.close(code=1011)
