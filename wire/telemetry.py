"""The live telemetry messages (seam 4 in docs/architecture.md), as agents send them and the
portal's consumers read them.

An agent publishes to groups named under its host, ``host.<name>.gpu.<uuid>``,
``host.<name>.sandbox.<id>`` and ``host.<name>.fleet``: its Redis user may publish there and
nowhere else (``wire.broker_acl``), so a compromised host cannot put figures, alerts or
output on another host's GPU or another tenant's sandbox page. The portal's consumers
subscribe to the groups of the host that holds what they show; the portal's own notices of
a sandbox go to ``sandbox.<id>``, which no host may publish to. ``type`` names the consumer
handler (``gpu.sample`` -> ``gpu_sample``, ``alert.changed`` -> ``alert_changed``,
``fleet.samples`` -> ``fleet_samples``: the fleet stream carries each host's samples of a
tick as one message). The newest sample of each device is also kept in
Redis for /metrics (``latest_key``).
"""

from __future__ import annotations

import json
import time
from typing import Any, TypedDict

HOST_GROUPS = "host.{host}."  # the prefix of every group a host's agent publishes to


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
    """An alert raised or cleared by an agent's rules (workers/host/alerts.py), sent live to the
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


def host_groups(host: str) -> str:
    """What every group ``host``'s agent publishes to starts with (its ACL's channel pattern)."""
    return HOST_GROUPS.format(host=host)


def gpu_group(host: str, uuid: str) -> str:
    """A GPU's samples and alerts, from the agent of the host it is in."""
    return f"{host_groups(host)}gpu.{uuid}"


def fleet_group(host: str) -> str:
    """Each tick's samples of all of one host's GPUs, and its alerts, for the fleet page."""
    return f"{host_groups(host)}fleet"


def host_sandbox_group(host: str, sandbox_id: int | str) -> str:
    """A sandbox's own figures, output and alerts, from the agent of the host running it."""
    return f"{host_groups(host)}sandbox.{sandbox_id}"


def sandbox_group(sandbox_id: int | str) -> str:
    """The portal's notices of a sandbox (state changes): no host publishes here."""
    return f"sandbox.{sandbox_id}"


class OutputMessage(TypedDict):
    """A piece of a batch's output for its page (group ``sandbox.<id>``)."""

    type: str  # "sandbox.output"
    sandbox: int
    start: int  # offset of the first byte in everything the sandbox wrote
    end: int  # offset just past the last (the text may differ in length: bytes replaced)
    text: str  # UTF-8, undecodable bytes replaced
    dropped: int  # bytes the host did not keep between the previous piece and this one


class SandboxChangedMessage(TypedDict):
    """A sandbox moved to another state (group ``sandbox.<id>``): its open pages fetch their
    status part once, instead of polling it (portal/sandboxes/live.py sends it)."""

    type: str  # "sandbox.changed"
    sandbox: int
    state: str


# The newest sample of every GPU and sampled MIG device, for /metrics: one Redis hash per
# host (field: device UUID, value: the sample message as JSON), rewritten every tick and
# expiring when its agent stops writing, so a silent host's figures vanish from the scrape.
LATEST_PREFIX = "gpushare:telemetry:latest:"
LATEST_TTL_S = 30


def latest_key(host: str) -> str:
    return f"{LATEST_PREFIX}{host}"


# A Slurm node's monitor hands each tick to its gateway here (workers.slurm.node_samples):
# one key per node, replaced every tick, gone when the monitor stops.
NODE_SAMPLES_PREFIX = "gpushare:telemetry:node:"
NODE_SAMPLES_TTL_S = 5


def node_samples_key(host: str) -> str:
    return f"{NODE_SAMPLES_PREFIX}{host}"


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
