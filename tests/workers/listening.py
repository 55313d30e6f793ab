"""The host's listening TCP sockets and who holds them, for the tests that show SSH into a
sandbox opens no port on the host (its sshd has no socket at all; ``ssh -L`` listens in the
client, and connects from inside the sandbox's own network namespace)."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

Listener = tuple[str, int]  # (address as /proc/net/tcp writes it, port)


def listening() -> dict[str, Listener]:
    """The host network namespace's listening sockets, by inode."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].rsplit(":", 1)
                found[fields[9]] = (address, int(port, 16))
    return found


def holders(inodes: set[str]) -> dict[str, str]:
    """A command line holding each of these socket inodes (processes' fds, as root reads them)."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    held: dict[str, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link in wanted:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    held[wanted[link]] = command.decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
    return held


def new_listeners(before: dict[str, Listener]) -> dict[Listener, str]:
    """Listening sockets opened since ``before``, each with a command line that holds it."""
    now = listening()
    added = set(now) - set(before)
    owners = holders(added)
    return {now[inode]: owners.get(inode, "?") for inode in added}


def page_through(port: int, timeout_s: float = 60.0) -> str:
    """What ``http://127.0.0.1:<port>/`` answers once an ``ssh -L`` forward to it is up
    (retried until then), or "" if it never came."""
    deadline, page = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline and not page:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                page = answer.read().decode()
        except OSError:
            time.sleep(0.3)
    return page
