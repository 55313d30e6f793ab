"""A ProxyCommand for the real OpenSSH client straight to a driver's ``open_ssh`` (no portal,
no relay): its stdin and stdout are the connection's bytes, as ``gpushare ssh-proxy``'s are.

    python -m tests.workers.ssh_proxy process|docker STATE_DIR ALLOCATION_KEY PUBLIC_KEY_FILE
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from wire.relay import Terminal


def _driver(kind: str, state_dir: str) -> object:
    if kind == "process":
        from workers.drivers.process import ProcessDriver

        return ProcessDriver(Path(state_dir))
    from workers.drivers.docker import DockerDriver

    return DockerDriver()


def main(kind: str, state_dir: str, allocation_key: str, key_file: str) -> int:
    driver = _driver(kind, state_dir)
    handle = next(h for h in driver.list_owned() if h.allocation_key == allocation_key)  # type: ignore[attr-defined]
    kind_, blob = Path(key_file).read_text().split()[:2]
    stream: Terminal = driver.open_ssh(handle, [f"{kind_} {blob}"])  # type: ignore[attr-defined]
    done = threading.Event()

    def inward() -> None:
        while chunk := os.read(0, 65536):
            try:
                stream.write(chunk)
            except EOFError:
                break
        done.set()

    threading.Thread(target=inward, daemon=True).start()
    try:
        while not done.is_set():
            try:
                data = stream.read(0.1)
            except EOFError as exc:
                sys.stderr.write(f"ssh_proxy: {exc}\n")
                break
            if data:
                os.write(1, data)
    finally:
        stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
