"""Applying what host agents report: heartbeats and GPU inventories.

Inventories come one host's at a time (an agent alone, a plan's re-layout) or a hundred at
a time (a process serving many simulated hosts, as it starts); either way they are applied
by one path, ``do_sync_inventories``, in a few bulk statements per batch (hosts, GPUs, MIG
instances each read and written together), not a query per GPU. An entry that cannot be
applied is refused with a log line naming its host, and the rest of its batch is applied.

State changes (a lost host back up, a GPU gone or back) go through ``portal.fleet.actions``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DataError, IntegrityError, transaction
from django.db.models import Q

from portal.fleet import actions
from portal.fleet.models import ENGINE_MODES, TIMESLICE_REPLICAS, Gpu, GpuMode, Host, MigInstance
from scheduler.topology import LEVELS
from wire.messages import HostFacts

log = logging.getLogger(__name__)
SMALL_INT = 32767  # PositiveSmallIntegerField's ceiling
BIG_INT = 2147483647  # PositiveIntegerField's


# What the database or the transition table says against one entry: its host is refused.
class ForeignDevice(ValueError):
    """An inventory listing a GPU or MIG device the database has on another host."""


REFUSALS = (IntegrityError, DataError, actions.FleetTransitionError, ForeignDevice)


@dataclass(frozen=True)
class Heartbeats:
    known: set[str]  # the hosts the database knows (the rest have sent no inventory yet)
    regained: list[str]  # those that were lost and are back up


def do_heartbeats(host_names: Collection[str], at: datetime, backend: str, driver: str) -> Heartbeats:
    """Record the agents' heartbeats at ``at`` (two statements, however many hosts beat); a
    lost host that beats again comes back up."""
    states = dict(Host.objects.filter(name__in=list(host_names)).values_list("name", "state"))
    if not states:
        return Heartbeats(set(), [])
    Host.objects.filter(name__in=list(states)).update(last_heartbeat_at=at, backend=backend, driver=driver)
    regained = []
    for name in (name for name, state in states.items() if state == Host.State.LOST):
        with transaction.atomic():
            host = Host.objects.select_for_update().filter(name=name, state=Host.State.LOST).first()
            if host is not None:  # not regained by another beat meanwhile
                actions.regain_host(host)
                regained.append(name)
    return Heartbeats(set(states), regained)


# --- an inventory, read and checked --------------------------------------------------------


class BadInventory(ValueError):
    """An inventory entry the portal cannot apply, and why."""


@dataclass(frozen=True)
class MigSeen:
    uuid: str
    profile: str
    start: int
    memory_slices: int
    memory_mib: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class GpuSeen:
    uuid: str
    index: int
    name: str
    model: str
    memory_mib: int
    mig_enabled: bool
    not_ready: str  # why it cannot run CUDA work now; "" when it can
    mig: tuple[MigSeen, ...]
    engine_modes: tuple[str, ...] = ()  # GpuInfo.engine_modes: () for every mode
    engine_replicas: int = 0  # GpuInfo.engine_replicas: 0 for the admin's
    numa_node: int | None = None  # GpuInfo.numa_node: None when not known
    links: dict[str, str] = field(default_factory=dict)  # GpuInfo.links, by peer index (Gpu.links)


@dataclass(frozen=True)
class HostSeen:
    """One host's inventory as its agent reported it (``wire.messages.InventoryReport``)."""

    name: str
    backend: str
    driver: str
    facts: HostFacts | None  # None: CPU and memory not reported (a plan's re-layout)
    gpus: tuple[GpuSeen, ...]
    started: bool  # the first since its agent started


def _text(data: Mapping[str, Any], key: str, longest: int, *, empty: bool = True) -> str:
    value = data.get(key, "")
    if not isinstance(value, str) or len(value) > longest or (not empty and not value):
        raise BadInventory(f"{key}: {value!r:.80} is not a text of 1 to {longest} characters")
    return value


def _int(data: Mapping[str, Any], key: str, highest: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= highest:
        raise BadInventory(f"{key}: {value!r:.80} is not a whole number from 0 to {highest}")
    return value


def _mig(data: Any) -> MigSeen:
    if not isinstance(data, Mapping):
        raise BadInventory(f"a MIG device {data!r:.80} is not an object")
    return MigSeen(
        uuid=_text(data, "uuid", 64, empty=False), profile=_text(data, "profile", 16, empty=False),
        start=_int(data, "start", SMALL_INT), memory_slices=_int(data, "memory_slices", SMALL_INT),
        memory_mib=_int(data, "memory_mib", BIG_INT),
        gpu_instance_id=_int(data, "gpu_instance_id", SMALL_INT),
        compute_instance_id=_int(data, "compute_instance_id", SMALL_INT),
    )  # fmt: skip


def _gpu(data: Any) -> GpuSeen:
    if not isinstance(data, Mapping):
        raise BadInventory(f"a GPU {data!r:.80} is not an object")
    devices = data.get("mig_devices") or []
    if not isinstance(devices, list | tuple) or not isinstance(data.get("mig_enabled"), bool):
        raise BadInventory(f"GPU {data.get('uuid')!r:.80}: mig_enabled or mig_devices malformed")
    return GpuSeen(
        uuid=_text(data, "uuid", 64, empty=False), index=_int(data, "index", SMALL_INT),
        name=_text(data, "name", 100), model=_text(data, "model", 40),
        memory_mib=_int(data, "memory_mib", BIG_INT), mig_enabled=data["mig_enabled"],
        # An agent before fabric checks sends none; the reason is kept to 200 characters.
        not_ready=str(data.get("not_ready") or ""), mig=tuple(_mig(d) for d in devices),
        engine_modes=_engine_modes(data),
        engine_replicas=_int(data, "engine_replicas", SMALL_INT) if "engine_replicas" in data else 0,
        # An agent before topology sends neither: not known.
        numa_node=_int(data, "numa_node", SMALL_INT) if data.get("numa_node") is not None else None,
        links=_links(data),
    )  # fmt: skip


def _links(data: Mapping[str, Any]) -> dict[str, str]:
    """GpuInfo.links ([[peer index, level], ...]) as Gpu.links stores them; a level this
    portal does not know (a newer agent's) is left out: not known."""
    links = data.get("links") or ()
    if not isinstance(links, list | tuple) or len(links) > SMALL_INT:
        raise BadInventory(f"GPU {data.get('uuid')!r:.80}: links {links!r:.80} is not a list")
    found = {}
    for link in links:
        peer, level = link if isinstance(link, list | tuple) and len(link) == 2 else (None, None)
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer <= SMALL_INT:
            peer = None
        if peer is None or not isinstance(level, str):
            raise BadInventory(f"GPU {data.get('uuid')!r:.80}: link {link!r:.80} is not [GPU index, level]")
        if level in LEVELS:
            found[str(peer)] = level
    return found


def _engine_modes(data: Mapping[str, Any]) -> tuple[str, ...]:
    modes = data.get("engine_modes") or ()
    if not isinstance(modes, list | tuple) or not set(modes) <= set(ENGINE_MODES):
        raise BadInventory(
            f"GPU {data.get('uuid')!r:.80}: engine_modes {modes!r:.80} not among {', '.join(ENGINE_MODES)}"
        )
    return tuple(m for m in ENGINE_MODES if m in modes)


def read_report(report: Any) -> HostSeen:
    """An ``InventoryReport`` checked: a ``BadInventory`` says what is wrong with it."""
    if not isinstance(report, Mapping):
        raise BadInventory(f"{report!r:.80} is not an object")
    name = _text(report, "host", 63, empty=False)
    facts = report.get("facts")
    if facts is not None:
        if not isinstance(facts, Mapping):
            raise BadInventory(f"facts {facts!r:.80} is not an object")
        facts = HostFacts(
            cpu_cores=_int(facts, "cpu_cores", BIG_INT), memory_mib=_int(facts, "memory_mib", BIG_INT)
        )
    gpus = report.get("gpus")
    if not isinstance(gpus, list | tuple):
        raise BadInventory(f"gpus {gpus!r:.80} is not a list")
    seen = tuple(_gpu(gpu) for gpu in gpus)
    uuids = [gpu.uuid for gpu in seen] + [mig.uuid for gpu in seen for mig in gpu.mig]
    if len(set(uuids)) != len(uuids):
        raise BadInventory("a GPU or MIG device is listed twice")
    return HostSeen(
        name=name, backend=_text(report, "backend", 16, empty=False), driver=_text(report, "driver", 16),
        facts=facts, gpus=seen, started=report.get("started") is True,
    )  # fmt: skip


def _label(report: Any, position: int) -> str:
    """How a log line names an entry, even a malformed one."""
    name = report.get("host") if isinstance(report, Mapping) else None
    return name[:63] if isinstance(name, str) and name else f"(entry {position}, no host name)"


# --- applied -----------------------------------------------------------------------------


@dataclass(frozen=True)
class InventoryOutcome:
    applied: list[HostSeen]
    refused: dict[str, str]  # host (as the entry names it) -> why it was not applied

    def by_software(self) -> dict[tuple[str, str], list[str]]:
        """The hosts applied, by (backend, driver)."""
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for host in self.applied:
            groups[(host.backend, host.driver)].append(host.name)
        return groups


def do_sync_inventories(reports: Sequence[Any]) -> InventoryOutcome:
    """Make the database's hosts, GPUs and MIG instances match what their agents see: a
    batch in one transaction of a few bulk statements. An entry that is malformed, or names
    a GPU another host of the batch also lists, is refused, with a log line naming its host;
    should the batch's statements break a constraint all the same, each host is applied in
    a transaction of its own, so that only the one at fault is refused. A host listed twice:
    its later entry counts (refused, it refuses the host). A database that cannot be reached
    raises, as for any task.

    GPUs are matched by UUID. A new GPU follows demand, or is shared by MIG when it is in
    MIG mode. An admin's pin is kept; only a change of MIG mode (a GPU reset on the host)
    changes the mode: into MIG, or out of it to following demand.

    A GPU the agent reports ``not_ready`` (its NVLink fabric not registered by Fabric
    Manager: CUDA would fail on it) is unavailable with that reason, and available again
    once an inventory reports it ready (the agent re-sends one when that changes).
    """
    hosts: dict[str, HostSeen] = {}
    refused: dict[str, str] = {}
    owner: dict[str, str] = {}  # GPU or MIG uuid -> the host of the batch that lists it
    for position, report in enumerate(reports):
        try:
            host = read_report(report)
            for uuid in [gpu.uuid for gpu in host.gpus] + [mig.uuid for gpu in host.gpus for mig in gpu.mig]:
                if owner.setdefault(uuid, host.name) != host.name:
                    raise BadInventory(f"{uuid} is listed by host {owner[uuid]} too")
        except BadInventory as exc:
            hosts.pop(_refuse(refused, _label(report, position), str(exc)), None)
            continue
        hosts[host.name] = host
    try:
        with transaction.atomic():
            _apply(list(hosts.values()))
        return InventoryOutcome(list(hosts.values()), refused)
    except REFUSALS as exc:
        log.warning("a batch of %d inventories failed whole (%s): applying each alone", len(hosts), exc)
    applied = []
    for host in hosts.values():
        try:
            with transaction.atomic():
                _apply([host])
        except REFUSALS as exc:
            _refuse(refused, host.name, str(exc))
        else:
            applied.append(host)
    return InventoryOutcome(applied, refused)


def _refuse(refused: dict[str, str], host: str, why: str) -> str:
    log.warning("inventory of host %s not applied: %s", host, why)
    refused[host] = why
    return host


def do_sync_inventory(
    host_name: str, backend: str, driver: str, gpus: list[dict[str, Any]], facts: HostFacts | None = None
) -> Host:
    """One host's inventory, in a transaction of its own (a plan's re-layout, the demo's
    fleet): ``do_sync_inventories``'s statements, raising what cannot be applied."""
    host = read_report(
        {"host": host_name, "backend": backend, "driver": driver, "gpus": gpus, "facts": facts}
    )
    with transaction.atomic():
        return _apply([host])[0]


def _apply(hosts: list[HostSeen]) -> list[Host]:
    """The batch's rows locked (hosts by name, then their GPUs), created or updated."""
    _refuse_foreign_devices(hosts)
    rows = _hosts(hosts)
    gpus = _gpus(hosts, rows)
    _mig_instances(hosts, gpus)
    return [rows[host.name] for host in hosts]


def _refuse_foreign_devices(hosts: list[HostSeen]) -> None:
    """A host speaks for itself alone (issue 38): an inventory listing a device the database
    has on another host would rewrite that host's GPU (its model, its MIG layout, an
    unavailable GPU made available again), so it is refused whole. Two queries a batch."""
    claimant = {
        uuid: host.name
        for host in hosts
        for gpu in host.gpus
        for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig))
    }
    owners = list(Gpu.objects.filter(uuid__in=list(claimant)).values_list("uuid", "host__name"))
    owners += MigInstance.objects.filter(uuid__in=list(claimant)).values_list("uuid", "gpu__host__name")
    for uuid, owner in owners:
        if owner != claimant[uuid]:
            raise ForeignDevice(f"{uuid} is host {owner}'s, not {claimant[uuid]}'s")


def _hosts(hosts: list[HostSeen]) -> dict[str, Host]:
    names = sorted(host.name for host in hosts)
    rows = {row.name: row for row in Host.objects.select_for_update().filter(name__in=names).order_by("name")}
    missing = [host for host in hosts if host.name not in rows]
    if missing:  # a concurrent first inventory of the same host may have made it: ignored, then read
        Host.objects.bulk_create(
            [Host(name=host.name, backend=host.backend, driver=host.driver) for host in missing],
            ignore_conflicts=True,
        )
        made = (
            Host.objects.select_for_update().filter(name__in=sorted(h.name for h in missing)).order_by("name")
        )
        rows.update({row.name: row for row in made})
    changed = []
    for host in hosts:
        row = rows[host.name]
        cpu, memory = (
            (host.facts["cpu_cores"], host.facts["memory_mib"])
            if host.facts
            else (row.cpu_cores, row.memory_mib)
        )
        if (row.backend, row.driver, row.cpu_cores, row.memory_mib) != (
            host.backend,
            host.driver,
            cpu,
            memory,
        ):
            row.backend, row.driver, row.cpu_cores, row.memory_mib = host.backend, host.driver, cpu, memory
            changed.append(row)
    Host.objects.bulk_update(changed, ["backend", "driver", "cpu_cores", "memory_mib"])
    return rows


def _mode(seen: GpuSeen, current: str) -> str:
    if seen.mig_enabled:
        return GpuMode.MIG
    return GpuMode.AUTO if current == GpuMode.MIG else current


def _gpus(hosts: list[HostSeen], rows: dict[str, Host]) -> dict[str, Gpu]:
    """Every reported GPU's row (uuid -> Gpu), created or brought up to date; the hosts' GPUs
    that were not reported made unavailable. Locked, so that a drain (portal.control.faults)
    cannot land between reading a GPU here and writing it back."""
    reported = {gpu.uuid: (host, gpu) for host in hosts for gpu in host.gpus}
    host_ids = [rows[host.name].pk for host in hosts]
    locked = Gpu.objects.select_for_update().filter(Q(host_id__in=host_ids) | Q(uuid__in=list(reported)))
    known = {gpu.uuid: gpu for gpu in locked.order_by("pk")}
    new = [uuid for uuid in reported if uuid not in known]
    Gpu.objects.bulk_create(
        Gpu(
            uuid=seen.uuid, host=rows[host.name], index=seen.index, name=seen.name, model=seen.model,
            memory_mib=seen.memory_mib, mig_enabled=seen.mig_enabled, sharing_mode=_mode(seen, GpuMode.AUTO),
            engine_modes=list(seen.engine_modes),
            timeslice_replicas=seen.engine_replicas or TIMESLICE_REPLICAS,
            numa_node=seen.numa_node, links=seen.links,
        )
        for host, seen in (reported[uuid] for uuid in new)
    )  # fmt: skip
    made = {gpu.uuid: gpu for gpu in Gpu.objects.select_for_update().filter(uuid__in=new).order_by("pk")}
    changed = []
    available_again: dict[str, list[Gpu]] = defaultdict(list)  # the event's message -> its GPUs
    for uuid, (host, seen) in reported.items():
        if uuid in made:
            if seen.not_ready:
                actions.gpu_not_ready(made[uuid], seen.not_ready)
            continue
        gpu = known[uuid]
        values = (seen.name, seen.model, seen.memory_mib, seen.mig_enabled, _mode(seen, gpu.sharing_mode))
        if (gpu.name, gpu.model, gpu.memory_mib, gpu.mig_enabled, gpu.sharing_mode) != values:
            gpu.name, gpu.model, gpu.memory_mib, gpu.mig_enabled, gpu.sharing_mode = values
            changed.append(gpu)
        # What the engine offers is its to say (Slurm's GRES), not the admin's.
        replicas = seen.engine_replicas or gpu.timeslice_replicas
        if (gpu.engine_modes, gpu.timeslice_replicas) != (list(seen.engine_modes), replicas):
            gpu.engine_modes, gpu.timeslice_replicas = list(seen.engine_modes), replicas
            changed.append(gpu)
        if (gpu.numa_node, gpu.links) != (seen.numa_node, seen.links):
            gpu.numa_node, gpu.links = seen.numa_node, seen.links
            changed.append(gpu)
        if seen.not_ready:
            actions.gpu_not_ready(gpu, seen.not_ready)
        elif gpu.state == Gpu.State.UNAVAILABLE:
            was = f" (it was unavailable: {gpu.unavailable_reason})" if gpu.unavailable_reason else ""
            available_again[f"available: host {host.name}'s agent offers it again{was}"].append(gpu)
    Gpu.objects.bulk_update(
        changed,
        [
            "name", "model", "memory_mib", "mig_enabled", "sharing_mode", "engine_modes",
            "timeslice_replicas", "numa_node", "links",
        ],
    )  # fmt: skip
    for message, back in available_again.items():
        actions.gpus_available(back, message)
    for host in hosts:
        row, listed = rows[host.name], {gpu.uuid for gpu in host.gpus}
        gone = [gpu for gpu in known.values() if gpu.host_id == row.pk and gpu.uuid not in listed]
        if gone:
            actions.gpus_unavailable(gone, f"unavailable: host {row.name}'s agent no longer sees it")
    return {uuid: made.get(uuid) or known[uuid] for uuid in reported}


def _mig_instances(hosts: list[HostSeen], gpus: dict[str, Gpu]) -> None:
    """The reported GPUs' MIG instances as reported. Those that vanished are removed unless a
    sandbox holds them now (then drift is repaired by reconciliation, which fails that
    sandbox first). Released allocations keep the instance's uuid in ``device_uuid``."""
    listed = {gpus[seen.uuid].pk: {mig.uuid for mig in seen.mig} for host in hosts for seen in host.gpus}
    removable = MigInstance.objects.filter(gpu_id__in=list(listed)).exclude(allocations__active=True)
    vanished = [
        pk for pk, gpu_id, uuid in removable.values_list("pk", "gpu_id", "uuid") if uuid not in listed[gpu_id]
    ]
    if vanished:
        MigInstance.objects.filter(pk__in=vanished).delete()
    reported = {mig.uuid: (gpus[seen.uuid], mig) for host in hosts for seen in host.gpus for mig in seen.mig}
    if not reported:
        return
    existing = {row.uuid: row for row in MigInstance.objects.filter(uuid__in=list(reported))}
    fields = [
        "gpu",
        "profile",
        "start",
        "memory_slices",
        "memory_mib",
        "gpu_instance_id",
        "compute_instance_id",
    ]
    new, changed = [], []
    for uuid, (gpu, mig) in reported.items():
        values = {
            "gpu": gpu, "profile": mig.profile, "start": mig.start, "memory_slices": mig.memory_slices,
            "memory_mib": mig.memory_mib, "gpu_instance_id": mig.gpu_instance_id,
            "compute_instance_id": mig.compute_instance_id,
        }  # fmt: skip
        row = existing.get(uuid)
        if row is None:
            new.append(MigInstance(uuid=uuid, **values))
        elif any(getattr(row, name) != value for name, value in values.items()):
            for name, value in values.items():
                setattr(row, name, value)
            changed.append(row)
    MigInstance.objects.bulk_update(changed, fields)
    MigInstance.objects.bulk_create(new)
