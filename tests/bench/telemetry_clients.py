"""Many WebSocket clients in one asyncio process, for the live-telemetry benchmark.

``python -m tests.bench.telemetry_clients CONFIG.json`` reads ``base`` (ws://host:port),
``origin``, ``cookie`` (or ``cookies``, one per client: each its own user), ``paths`` (one
per client), ``warmup_s``, ``duration_s``,
``drain_s`` and ``out``. It opens every client, writes ``<out>.window`` with the
measurement window (epoch seconds) once all are subscribed, reads until the window's end
plus ``drain_s`` (so samples taken just before the end still count) and writes ``out``:
per client its path, ``[gpu, t, received_ms]`` for each sample whose agent time ``t``
falls in the window, and the close code if the server closed it early.

Clients do nothing but read and parse, as a browser tab that keeps up would: a sample
missing from here was dropped upstream, not refused by a slow reader.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

CONNECT_AT_ONCE = 20  # the handshake runs a session and permission query each; don't stampede


async def _open(base: str, path: str, origin: str, cookie: str) -> ClientConnection:
    return await connect(
        base + path,
        origin=origin,  # type: ignore[arg-type]  # the server checks it against ALLOWED_HOSTS
        additional_headers={"Cookie": cookie},
        open_timeout=60,
        max_size=2**20,
    )


async def _read(ws: ClientConnection, start_ms: int, end_ms: int, until: float) -> dict[str, Any]:
    """The window's samples this client got, and the close code if the server closed it."""
    rows: list[list[int | float | str]] = []
    while (left := until - time.time()) > 0:
        try:
            raw = await asyncio.wait_for(ws.recv(), timeout=left)
        except TimeoutError:
            break
        except ConnectionClosed as exc:
            return {"rows": rows, "closed": exc.rcvd.code if exc.rcvd else 1006}
        received_ms = time.time() * 1000
        message = json.loads(raw)
        # The fleet stream batches each host's samples of a tick into one message.
        batch = message.get("samples", []) if message.get("type") == "fleet.samples" else [message]
        for sample in batch:
            if sample.get("type") == "gpu.sample" and start_ms <= sample["t"] < end_ms:
                rows.append([sample["gpu"], sample["t"], round(received_ms, 1)])
    return {"rows": rows, "closed": None}


async def main(config: dict[str, Any]) -> None:
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)

    async def opened_as(path: str, cookie: str) -> ClientConnection:
        async with gate:
            return await _open(config["base"], path, config["origin"], cookie)

    paths = config["paths"]
    cookies = config.get("cookies") or [config["cookie"]] * len(paths)
    sockets = await asyncio.gather(*(opened_as(p, c) for p, c in zip(paths, cookies, strict=True)))
    start = time.time() + config["warmup_s"]
    end = start + config["duration_s"]
    out = Path(config["out"])
    window = out.with_suffix(".window")
    window.with_suffix(".tmp").write_text(json.dumps({"start": start, "end": end}))
    window.with_suffix(".tmp").rename(window)  # whole or absent for the reader polling it
    until = end + config["drain_s"]
    # Reading starts now: the warm-up's samples are read (and dropped) like the window's.
    results = await asyncio.gather(*(_read(ws, int(start * 1000), int(end * 1000), until) for ws in sockets))
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    out.write_text(json.dumps([{"path": p, **r} for p, r in zip(config["paths"], results, strict=True)]))


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
