"""GET /metrics: the fleet in the Prometheus text format.

GPU figures carry the DCGM exporter's metric names and labels, so dashboards made for
dcgm-exporter (NVIDIA's Grafana dashboard among them) read them unchanged:

- every series: ``gpu`` (index), ``UUID``, ``device`` (``nvidia<index>``, as dcgm-exporter
  derives it), ``modelName`` (the name NVML reports) and ``Hostname``;
- a MIG device's series: the parent GPU's ``gpu``/``UUID``/``modelName`` plus
  ``GPU_I_PROFILE`` and ``GPU_I_ID``, as dcgm-exporter labels a GPU instance;
- a whole GPU or MIG device that one sandbox holds: ``namespace`` (its project),
  ``pod`` and ``container`` (``sandbox-<id>``), as dcgm-exporter's Kubernetes mapping
  labels a device a pod holds; on other devices the three are absent, as there.

dcgm-exporter's ``pci_bus_id`` and ``DCGM_FI_DRIVER_VERSION`` labels are left out: the agents
do not report them, and Prometheus reads an absent label as an empty one.

The figures are the newest sample of every device that the agents keep in Redis
(``wire.telemetry.read_latest``). A device without a fresh sample has no such series, so
a GPU that went silent shows as a gap rather than as its last values. The ``gpushare_*``
series describe the platform from the database: inventory, sandboxes, queue, alerts, cost.
Each scrape reads the database in a fixed number of queries, however large the fleet.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.conf import settings
from django.db.models import Count, Min, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from portal.billing.ledger import COSTED_FIELDS, running_cost_micros
from portal.billing.models import UsageRecord
from portal.catalog.models import Tier
from portal.fleet.models import SIMULATED_BACKENDS, Gpu, Host, MigInstance
from portal.inputs import whole_number
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from portal.telemetry import control_figures
from portal.telemetry.exposition import text_format
from portal.telemetry.models import Alert
from wire.telemetry import read_latest

log = logging.getLogger(__name__)

MIB = 1024 * 1024

# NVML's clock event ("throttle") reason bits, which DCGM reports unchanged, by the names
# GpuSample.throttle gives them (workers/gpu/nvml.py decodes the same bits into them).
CLOCK_EVENT_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clock_setting": 0x100,
}


def clock_event_bits(names: list[str]) -> int:
    bits = 0
    for name in names:
        bits |= CLOCK_EVENT_BITS.get(name, 0)
    return bits


def _free_mib(m: dict[str, Any]) -> int | None:
    used, total = m.get("mem_used_mib"), m.get("mem_total_mib")
    return None if used is None or total is None else max(0, total - used)


def _throttle(m: dict[str, Any]) -> int | None:
    return None if m.get("throttle") is None else clock_event_bits(m["throttle"])


# (DCGM field name, help, value from a sample message or None when the sample lacks it).
# Every one is exposed as a gauge: prometheus_client renames a counter to <name>_total,
# which would break the DCGM names; the type line is metadata, queries do not read it.
DCGM_FIELDS: tuple[tuple[str, str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda m: m.get("temp_c")),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda m: m.get("util_pct")),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda m: m.get("mem_used_mib")),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", _free_mib),
    ("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", lambda m: m.get("mem_total_mib")),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda m: m.get("power_w")),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda m: m.get("sm_clock_mhz")),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event reasons (NVML bitmask).", _throttle),
    # The same field under its name before DCGM 3.3, for dashboards written against it.
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons (NVML bitmask).", _throttle),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error seen (0: none).", lambda m: m.get("xid")),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Single-bit volatile ECC errors since the driver loaded.",
        lambda m: m.get("ecc_corrected"),
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Double-bit volatile ECC errors since the driver loaded.",
        lambda m: m.get("ecc_uncorrected"),
    ),
)


@dataclass(frozen=True)
class _Device:
    labels: dict[str, str]
    order: tuple[str, int, int]  # host, GPU index, GPU instance (-1: the whole GPU)


class FleetCollector(Collector):
    """Reads the database when collected: one scrape, one consistent set of queries."""

    def __init__(self, store: _Store, now: datetime) -> None:
        self.latest = store.latest
        self.control = store.control
        self.store_up = store.up
        self.now = now

    def collect(self) -> Iterator[Metric]:
        gpus = list(
            Gpu.objects.order_by("host__name", "index").values(
                "uuid",
                "index",
                "name",
                "model",
                "state",
                "mig_enabled",
                "sharing_mode",
                "host__name",
                "host__backend",
            )
        )
        yield from self._dcgm(gpus)
        yield from self._inventory(gpus)
        yield from self._sandboxes()
        yield from self._running_sandboxes()
        yield from self._alerts_and_cost()
        yield from self._control()
        up = GaugeMetricFamily(
            "gpushare_telemetry_store_up",
            "1 when the newest GPU samples could be read from Redis for this scrape, else 0.",
        )
        up.add_metric([], 1 if self.store_up else 0)
        yield up

    def _control(self) -> Iterator[Metric]:
        """How the control worker keeps up: its newest figures (absent before the first)."""
        for figure, name, help_text in (
            (control_figures.HEARTBEAT_LAG, "gpushare_heartbeat_lag_seconds",
             "How late the control worker applied the newest heartbeat message (from its oldest beat)."),
            (control_figures.CYCLE, "gpushare_scheduling_cycle_seconds",
             "How long the newest scheduling cycle that had requests to decide took."),
        ):  # fmt: skip
            if figure in self.control:
                family = GaugeMetricFamily(name, help_text)
                family.add_metric([], self.control[figure][1] / 1000)
                yield family

    # --- DCGM-compatible GPU series ---------------------------------------------------------

    def _devices(self, gpus: Sequence[Mapping[str, Any]]) -> dict[str, _Device]:
        by_uuid = {g["uuid"]: g for g in gpus}
        sampled_migs = [uuid for uuid, m in self.latest.items() if m.get("parent")]
        holders = {
            row["device_uuid"]: row
            for row in Allocation.objects.filter(
                active=True, kind__in=[Allocation.Kind.EXCLUSIVE, Allocation.Kind.MIG]
            ).values("device_uuid", "sandbox_id", "sandbox__project__slug")
        }
        devices: dict[str, _Device] = {}
        for gpu in gpus:
            order = (gpu["host__name"], gpu["index"], -1)
            devices[gpu["uuid"]] = _Device(_gpu_labels(gpu), order)
        for mig in MigInstance.objects.filter(uuid__in=sampled_migs).values(
            "uuid", "profile", "gpu_instance_id", "gpu__uuid"
        ):
            parent = by_uuid.get(mig["gpu__uuid"])
            if parent is not None:
                labels = _gpu_labels(parent)
                labels["GPU_I_PROFILE"] = mig["profile"]
                labels["GPU_I_ID"] = str(mig["gpu_instance_id"])
                order = (parent["host__name"], parent["index"], mig["gpu_instance_id"])
                devices[mig["uuid"]] = _Device(labels, order)
        for uuid, device in devices.items():
            holder = holders.get(uuid)
            if holder is not None:
                pod = f"sandbox-{holder['sandbox_id']}"
                device.labels.update(namespace=holder["sandbox__project__slug"], pod=pod, container=pod)
        return devices

    def _dcgm(self, gpus: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        devices = self._devices(gpus)
        # In a fixed order, so a device's series keep their place between scrapes.
        sampled = sorted(
            ((devices[uuid], message) for uuid, message in self.latest.items() if uuid in devices),
            key=lambda pair: pair[0].order,
        )
        for name, help_text, value_of in DCGM_FIELDS:
            family = GaugeMetricFamily(name, help_text)
            for device, message in sampled:
                # None: not measured (NVML has no utilization on a MIG device nor on a GPU
                # in MIG mode, and GPM was not there to measure it): the series is left
                # out, as dcgm-exporter leaves the field out, never exported as 0.
                value = value_of(message)
                if value is not None:
                    # A Sample, not add_metric: label sets differ by device (instance and
                    # holder labels only where they apply), as in dcgm-exporter's output.
                    family.samples.append(Sample(name, device.labels, float(value)))
            if family.samples:
                yield family

    # --- gpushare series --------------------------------------------------------------------

    def _inventory(self, gpus: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gpushare_gpu_info",
            'Every GPU of the inventory (1); mode="auto" for a GPU that follows demand, else the mode '
            'it is pinned to (or "mig"); simulated="true" for a GPU of the simulated backend.',
            labels=["UUID", "Hostname", "gpu", "modelName", "model", "state", "mode", "simulated"],
        )
        by_state = dict.fromkeys(Gpu.State.values, 0)
        for gpu in gpus:
            simulated = "true" if gpu["host__backend"] in SIMULATED_BACKENDS else "false"
            mode = "mig" if gpu["mig_enabled"] else gpu["sharing_mode"]
            info.add_metric(
                [
                    gpu["uuid"],
                    gpu["host__name"],
                    str(gpu["index"]),
                    gpu["name"],
                    gpu["model"],
                    gpu["state"],
                    mode,
                    simulated,
                ],
                1,
            )
            by_state[gpu["state"]] = by_state.get(gpu["state"], 0) + 1
        yield info
        yield _by_label("gpushare_gpus", "GPUs in the inventory, by state.", "state", by_state)
        hosts = dict.fromkeys(Host.State.values, 0)
        hosts.update(Host.objects.order_by().values_list("state").annotate(n=Count("id")))
        yield _by_label("gpushare_hosts", "GPU hosts, by state.", "state", hosts)

    def _sandboxes(self) -> Iterator[Metric]:
        counts = {
            (state, tier): n
            for state, tier, n in Sandbox.objects.order_by()
            .values_list("state", "tier__slug")
            .annotate(n=Count("id"))
        }
        family = GaugeMetricFamily(
            "gpushare_sandboxes",
            "Sandboxes by state, tier and the tier's sharing mode (ended ones included).",
            labels=["state", "tier", "mode"],
        )
        for tier, mode in Tier.objects.order_by("slug").values_list("slug", "sharing_mode"):
            for state in SandboxState.values:
                family.add_metric([state, tier, mode], counts.get((state, tier), 0))
        yield family
        queue = Sandbox.objects.filter(state=SandboxState.QUEUED).aggregate(
            n=Count("id"), oldest=Min("requested_at")
        )
        length = GaugeMetricFamily("gpushare_queue_length", "Sandboxes waiting in the queue.")
        length.add_metric([], queue["n"])
        yield length
        oldest = queue["oldest"]
        wait = max(0.0, (self.now - oldest).total_seconds()) if oldest is not None else 0.0
        waited = GaugeMetricFamily(
            "gpushare_queue_oldest_wait_seconds",
            "Seconds since the oldest queued sandbox was requested (0: empty queue).",
        )
        waited.add_metric([], wait)
        yield waited

    def _running_sandboxes(self) -> Iterator[Metric]:
        """Per sandbox, from the samples' figures. A sandbox appears in the sample of its GPU
        and, on MIG, of its MIG device too: the device's own figures are preferred, and
        a sandbox on several GPUs adds up their memory and averages their utilization. Its
        cost is billing's: its open usage interval's running cost (the samples carry none)."""
        seen: dict[str, list[tuple[bool, dict[str, Any]]]] = defaultdict(list)
        for message in self.latest.values():
            for sandbox_id, figures in (message.get("sandboxes") or {}).items():
                seen[sandbox_id].append((bool(message.get("parent")), figures))
        ids = [n for s in seen if (n := whole_number(s)) is not None]
        rows = {
            str(row["pk"]): row
            for row in Sandbox.objects.filter(pk__in=ids).values(
                "pk", "project__slug", "owner__username", "tier__slug", "tier__currency"
            )
        }
        placed = UsageRecord.objects.filter(sandbox_id__in=ids, ended_at__isnull=True).only(
            "sandbox_id", *COSTED_FIELDS
        )
        spent: dict[str, int] = defaultdict(int)
        for record in placed:
            spent[str(record.sandbox_id)] += running_cost_micros(record, self.now)
        names = ["sandbox", "project", "owner", "tier"]
        memory = GaugeMetricFamily(
            "gpushare_sandbox_gpu_memory_used_bytes", "GPU memory a running sandbox holds.", labels=names
        )
        util = GaugeMetricFamily(
            "gpushare_sandbox_gpu_utilization_ratio",
            "Utilization (0-1) of the GPU or MIG device a running sandbox runs on; on a shared GPU "
            "(MPS, time-slice) its own processes' share of the GPU's time (no series where that "
            "is not measured).",
            labels=names,
        )
        cost = CounterMetricFamily(
            "gpushare_sandbox_cost_micros",
            "Running cost of a sandbox's current placement, in millionths of the currency.",
            labels=[*names, "currency"],
        )
        for sandbox_id in sorted(rows, key=int):
            row, entries = rows[sandbox_id], seen[sandbox_id]
            own = [f for on_mig, f in entries if on_mig] or [f for _, f in entries]
            labels = [sandbox_id, row["project__slug"], row["owner__username"], row["tier__slug"]]
            memory.add_metric(labels, sum(f.get("mem_mib", 0) for f in own) * MIB)
            measured = [f["util_pct"] for f in own if f.get("util_pct") is not None]
            if measured:  # none measured (MIG without GPM): no series, not an idle 0
                util.add_metric(labels, sum(measured) / len(measured) / 100)
            cost.add_metric([*labels, row["tier__currency"]], spent[sandbox_id])
        yield from (memory, util, cost)

    def _alerts_and_cost(self) -> Iterator[Metric]:
        alerts = dict.fromkeys(Alert.Kind.values, 0)
        alerts.update(
            Alert.objects.filter(cleared_at__isnull=True)
            .order_by()
            .values_list("kind")
            .annotate(n=Count("id"))
        )
        yield _by_label("gpushare_alerts_open", "Alerts open now, by kind.", "kind", alerts)
        totals: dict[tuple[str, str], int] = defaultdict(int)
        closed = (
            UsageRecord.objects.filter(ended_at__isnull=False)
            .order_by()
            .values_list("project__slug", "currency")
            .annotate(total=Sum("cost_micros"))
        )
        for project, currency, total in closed:
            totals[(project, currency)] += total or 0
        open_records = (
            UsageRecord.objects.filter(ended_at__isnull=True)
            .select_related("project")
            .only("project__slug", "currency", *COSTED_FIELDS)
        )
        for record in open_records:
            totals[(record.project.slug, record.currency)] += running_cost_micros(record, self.now)
        family = CounterMetricFamily(
            "gpushare_usage_cost_micros",
            "Cost of all usage, ended intervals plus running ones, in millionths of the currency.",
            labels=["project", "currency"],
        )
        for (project, currency), total in sorted(totals.items()):
            family.add_metric([project, currency], total)
        yield family


def _gpu_labels(gpu: Mapping[str, Any]) -> dict[str, str]:
    index = str(gpu["index"])
    return {
        "gpu": index,
        "UUID": gpu["uuid"],
        "device": f"nvidia{index}",
        "modelName": gpu["name"],
        "Hostname": gpu["host__name"],
    }


def _by_label(name: str, help_text: str, label: str, counts: dict[str, int]) -> GaugeMetricFamily:
    """Every known value gets a series, 0 included, so a count that drops to zero reads 0
    instead of vanishing."""
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


# --- the view --------------------------------------------------------------------------------


@dataclass
class _Store:
    """What a scrape reads from Redis: the newest GPU samples and control figures."""

    latest: dict[str, dict[str, Any]]
    control: dict[str, tuple[int, float]]  # figure -> its newest (at_ms, value_ms)
    up: bool


def _read_store() -> _Store:
    """Or nothing when Redis does not answer: the database's series are still worth a
    scrape, and ``gpushare_telemetry_store_up`` says what is missing."""
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        try:
            latest = read_latest(client)
            control = {
                figure: newest[0]
                for figure in (control_figures.HEARTBEAT_LAG, control_figures.CYCLE)
                if (newest := control_figures.read(client, figure, 1))
            }
            return _Store(latest, control, True)
        finally:
            client.close()
    except (redis.RedisError, ValueError) as exc:
        log.warning("/metrics: cannot read the newest GPU samples: %s", exc)
        return _Store({}, {}, False)


def _denied(request: HttpRequest) -> HttpResponse | None:
    """Prometheus presents ``METRICS_TOKEN`` as a bearer token; a person needs a staff
    session. A presented token is judged alone, so a wrong one is refused even with a session."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        token = settings.METRICS_TOKEN
        if token and hmac.compare_digest(credentials.strip().encode(), token.encode()):
            return None
        return _unauthorized()
    if not request.user.is_authenticated:
        return _unauthorized()
    if not request.user.is_staff:
        return HttpResponse("Metrics are for staff and Prometheus.\n", status=403, content_type="text/plain")
    return None


def _unauthorized() -> HttpResponse:
    response = HttpResponse(
        "A bearer token or a staff session is needed.\n", status=401, content_type="text/plain"
    )
    response["WWW-Authenticate"] = 'Bearer realm="gpushare metrics"'
    return response


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    denied = _denied(request)
    if denied is not None:
        return denied
    # A private registry: the process-wide one would add this process's own Python metrics,
    # which differ by which web worker answered.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(_read_store(), timezone.now()))
    with _no_cyclic_gc():
        body = text_format(registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A scrape at the openb cluster's size allocates some 100,000 samples and their label
    dicts in under a second, and the cyclic collector ran over them again and again: 0.5 s
    of 1.4 s (tests/bench/test_openb_pages.py). Nothing built here needs a cycle collected
    before the body is written, so collection waits until then. Process-wide, and so
    re-enabled only by the scrape that disabled it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
