"""The one typed publisher of live samples (seam 4 in docs/architecture.md), used by every
sender on a host. The messages themselves are ``wire.telemetry``'s."""

from __future__ import annotations

import json
from typing import Any

from channels_redis.pubsub import RedisPubSubChannelLayer

from wire.config import CHANNEL_LAYER_OPTIONS
from wire.telemetry import (
    LATEST_TTL_S,
    AlertMessage,
    FleetSamplesMessage,
    GpuSampleMessage,
    OutputMessage,
    SandboxFigures,
    latest_key,
)
from workers.gpu.base import GpuSample


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


def make_layer(redis_url: str) -> RedisPubSubChannelLayer:
    """The portal's channel layer (``wire.config.CHANNEL_LAYER_BACKEND``) without Django
    settings: agents only know the broker URL."""
    return RedisPubSubChannelLayer(hosts=[redis_url], **CHANNEL_LAYER_OPTIONS)


async def publish(
    layer: RedisPubSubChannelLayer,
    group: str,
    message: GpuSampleMessage | AlertMessage | FleetSamplesMessage | OutputMessage,
) -> None:
    await layer.group_send(group, dict(message))


async def store_latest(client: Any, host: str, messages: list[GpuSampleMessage]) -> None:
    """``client`` is a ``redis.asyncio.Redis``; one round trip per tick."""
    if not messages:
        return
    key = latest_key(host)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping={m["gpu"]: json.dumps(m) for m in messages})
    pipe.expire(key, LATEST_TTL_S)
    await pipe.execute()
