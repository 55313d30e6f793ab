"""The host agent's sampler alone, for the live-telemetry benchmark (test_telemetry_stream.py).

``python -m tests.bench.telemetry_sampler HOST SIM_SPEC INTERVAL_S OUT.json`` builds an
``Agent`` on simulated GPUs and runs its ``sample_forever`` until SIGTERM, then writes
every group send it made: ``[group, gpu, t, done_ms]`` rows, ``t`` being the sample's
agent timestamp and ``done_ms`` when Redis held the message. The benchmark counts what
clients should have received from these rows, so a send the agent skipped or that failed
is not charged to the stream.

The rows are taken by wrapping the channel layer's ``group_send`` (``RedisPubSubLoopLayer``'s:
the layer object proxies it to one per event loop) rather than the agent's ``publish``: every
sender in this process goes through the layer, whatever the agent calls. The wrapper appends
one tuple per send, next to the send's Redis PUBLISH.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from channels_redis.pubsub import RedisPubSubLoopLayer

from workers.drivers.process import ProcessDriver
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec
from workers.host.agent import Agent

SENT: list[tuple[str, str, int, int]] = []
_group_send = RedisPubSubLoopLayer.group_send


async def _recorded_group_send(self: RedisPubSubLoopLayer, group: str, message: dict[str, Any]) -> None:
    await _group_send(self, group, message)
    done_ms = int(time.time() * 1000)
    # The fleet stream carries a host's samples of a tick as one ``fleet.samples`` message.
    batch = message.get("samples", []) if message.get("type") == "fleet.samples" else [message]
    for sample in batch:
        if sample.get("type") == "gpu.sample":
            SENT.append((group, str(sample["gpu"]), int(sample["t"]), done_ms))


async def main(host: str, spec: str, interval_s: float, out: Path) -> None:
    RedisPubSubLoopLayer.group_send = _recorded_group_send
    backend = SimulatedBackend(host, parse_sim_spec(spec))
    # Never launches anything: the process driver only needs a folder to list (empty).
    driver = ProcessDriver(Path(tempfile.mkdtemp(prefix="bench-sampler-")), host=host)
    agent = Agent(host, backend, driver, Path(tempfile.mkdtemp(prefix="bench-agent-")))
    # What the worker's start() does, without reporting it to a control queue.
    agent.context.inventory.refresh()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, agent.shutdown)
    # One heartbeat at the first tick (to a control queue nobody reads), none after.
    await agent.sampler.sample_forever(interval_s, heartbeat_s=86_400)
    out.write_text(json.dumps(SENT))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])))
