"""The one typed publisher of live samples (DESIGN.md seam 4), used by every sender.

Messages go to the channel layer groups ``gpu.<uuid>``, ``sandbox.<id>`` and ``fleet``;
``type`` names the consumer handler (``gpu.sample`` -> ``gpu_sample``).
"""

from __future__ import annotations

from typing import TypedDict

from channels_redis.core import RedisChannelLayer

from workers.gpu.base import GpuSample

FLEET_GROUP = "fleet"


class SandboxFigures(TypedDict):
    mem_mib: int
    util_pct: float
    cost_micros: int


class GpuSampleMessage(TypedDict):
    type: str  # "gpu.sample"
    gpu: str
    host: str
    t: int  # epoch ms at the agent
    temp_c: float
    util_pct: float
    mem_used_mib: int
    mem_total_mib: int
    power_w: float
    sm_clock_mhz: int
    throttle: list[str]
    simulated: bool
    sandboxes: dict[str, SandboxFigures]


def gpu_group(uuid: str) -> str:
    return f"gpu.{uuid}"


def sandbox_group(sandbox_id: int | str) -> str:
    return f"sandbox.{sandbox_id}"


def sample_message(
    sample: GpuSample, host: str, simulated: bool, sandboxes: dict[str, SandboxFigures]
) -> GpuSampleMessage:
    return GpuSampleMessage(
        type="gpu.sample",
        gpu=sample.uuid,
        host=host,
        t=sample.t_ms,
        temp_c=round(sample.temp_c, 1),
        util_pct=round(sample.util_pct, 1),
        mem_used_mib=sample.mem_used_mib,
        mem_total_mib=sample.mem_total_mib,
        power_w=round(sample.power_w, 1),
        sm_clock_mhz=sample.sm_clock_mhz,
        throttle=list(sample.throttle),
        simulated=simulated,
        sandboxes=sandboxes,
    )


def make_layer(redis_url: str) -> RedisChannelLayer:
    """A channel layer without Django settings: agents only know the broker URL."""
    return RedisChannelLayer(hosts=[redis_url], capacity=200, expiry=10)


async def publish(layer: RedisChannelLayer, group: str, message: GpuSampleMessage) -> None:
    await layer.group_send(group, dict(message))
