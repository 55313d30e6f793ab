"""The one typed publisher of live samples (seam 4 in docs/architecture.md), used by every sender.

Messages go to the channel layer groups ``gpu.<uuid>``, ``sandbox.<id>`` and ``fleet``;
``type`` names the consumer handler (``gpu.sample`` -> ``gpu_sample``, ``alert.changed``
-> ``alert_changed``, ``fleet.samples`` -> ``fleet_samples``: the fleet stream carries each
host's samples of a tick as one message).
"""

from __future__ import annotations

import json
import time
from typing import Any, TypedDict

from channels_redis.core import RedisChannelLayer

from workers.batch_output import OutputMessage
from workers.config import CHANNEL_LAYER_OPTIONS
from workers.gpu.base import GpuSample

FLEET_GROUP = "fleet"


class SandboxFigures(TypedDict):
    """A sandbox's own figures in a sample. No cost: the agent knows no price; the portal's
    billing computes the running cost (portal.billing.ledger) and the sandbox stream's
    consumer adds it to the samples it forwards (portal/telemetry/consumers.py)."""

    mem_mib: int
    util_pct: float | None  # None: unmeasured (a MIG device without GPM), never "idle"


class GpuSampleMessage(TypedDict):
    type: str  # "gpu.sample"
    gpu: str
    host: str
    t: int  # epoch ms at the agent
    temp_c: float
    util_pct: float | None  # None (JSON null): the device's utilization is not measured
    mem_used_mib: int
    mem_total_mib: int
    power_w: float
    sm_clock_mhz: int
    throttle: list[str]
    simulated: bool
    sandboxes: dict[str, SandboxFigures]
    # Beyond the seam's first shape, for /metrics and alerts: board ECC counts, the last XID
    # seen (0: none) and, for a MIG device's sample, its parent GPU's UUID ("" otherwise).
    ecc_corrected: int
    ecc_uncorrected: int
    xid: int
    parent: str


class FleetSamplesMessage(TypedDict):
    """The downsampled ``fleet`` stream: one host's GPU samples of one tick, together."""

    type: str  # "fleet.samples"
    host: str
    t: int
    samples: list[GpuSampleMessage]


def fleet_message(host: str, t_ms: int, samples: list[GpuSampleMessage]) -> FleetSamplesMessage:
    return FleetSamplesMessage(type="fleet.samples", host=host, t=t_ms, samples=samples)


class AlertMessage(TypedDict):
    """An alert raised or cleared by an agent's rules (workers/alerts.py), sent live to the
    subject's groups and to ``fleet``, and to the control worker which stores it."""

    type: str  # "alert.changed"
    key: str  # made when raised; the clearing carries the same key
    state: str  # "raised" | "cleared"
    kind: str  # temperature, throttle, xid, utilization, memory
    host: str
    gpu: str  # the GPU (a MIG device's parent) the alert is about
    sandbox: int | None  # set for a sandbox's alert (its tier's thresholds)
    value: float
    threshold: float
    message: str
    t: int  # epoch ms at the agent


def gpu_group(uuid: str) -> str:
    return f"gpu.{uuid}"


def sandbox_group(sandbox_id: int | str) -> str:
    return f"sandbox.{sandbox_id}"


def sample_message(
    sample: GpuSample,
    host: str,
    simulated: bool,
    sandboxes: dict[str, SandboxFigures],
    xid: int = 0,
    parent: str = "",
) -> GpuSampleMessage:
    return GpuSampleMessage(
        type="gpu.sample",
        gpu=sample.uuid,
        host=host,
        t=sample.t_ms,
        temp_c=round(sample.temp_c, 1),
        util_pct=None if sample.util_pct is None else round(sample.util_pct, 1),
        mem_used_mib=sample.mem_used_mib,
        mem_total_mib=sample.mem_total_mib,
        power_w=round(sample.power_w, 1),
        sm_clock_mhz=sample.sm_clock_mhz,
        throttle=list(sample.throttle),
        simulated=simulated,
        sandboxes=sandboxes,
        ecc_corrected=sample.ecc_corrected,
        ecc_uncorrected=sample.ecc_uncorrected,
        xid=xid,
        parent=parent,
    )


def make_layer(redis_url: str) -> RedisChannelLayer:
    """A channel layer without Django settings: agents only know the broker URL."""
    return RedisChannelLayer(hosts=[redis_url], **CHANNEL_LAYER_OPTIONS)


async def publish(
    layer: RedisChannelLayer,
    group: str,
    message: GpuSampleMessage | AlertMessage | FleetSamplesMessage | OutputMessage,
) -> None:
    await layer.group_send(group, dict(message))


# The newest sample of every GPU and sampled MIG device, for /metrics: one Redis hash per
# host (field: device UUID, value: the sample message as JSON), rewritten every tick and
# expiring when its agent stops writing, so a silent host's figures vanish from the scrape.
LATEST_PREFIX = "gpushare:telemetry:latest:"
LATEST_TTL_S = 30


def latest_key(host: str) -> str:
    return f"{LATEST_PREFIX}{host}"


async def store_latest(client: Any, host: str, messages: list[GpuSampleMessage]) -> None:
    """``client`` is a ``redis.asyncio.Redis``; one round trip per tick."""
    if not messages:
        return
    key = latest_key(host)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping={m["gpu"]: json.dumps(m) for m in messages})
    pipe.expire(key, LATEST_TTL_S)
    await pipe.execute()


def read_latest(client: Any) -> dict[str, dict[str, Any]]:
    """Every stored newest sample by device UUID; ``client`` is a sync ``redis.Redis``.
    Samples older than LATEST_TTL_S (a host whose agent died mid-hash) are left out."""
    cutoff_ms = (time.time() - LATEST_TTL_S) * 1000
    latest: dict[str, dict[str, Any]] = {}
    keys = list(client.scan_iter(match=f"{LATEST_PREFIX}*", count=1000))
    pipe = client.pipeline(transaction=False)  # one round trip for every host's hash
    for key in keys:
        pipe.hgetall(key)
    for samples in pipe.execute():
        for uuid, raw in samples.items():
            message = json.loads(raw)
            if message.get("t", 0) >= cutoff_ms:
                latest[uuid.decode() if isinstance(uuid, bytes) else uuid] = message
    return latest
