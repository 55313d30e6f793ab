"""First fit: hosts and GPUs in name/index order, the first that can take the request."""

from __future__ import annotations

from scheduler.cluster import (
    CPU_ONLY,
    DEDICATED,
    MIG,
    MPS,
    TIMESLICE,
    DeviceGrant,
    GpuState,
    HostState,
    Pending,
    Place,
    Request,
    Snapshot,
)
from scheduler.gpus import COMPUTE_SLICES, MODELS
from scheduler.placement.workload import accessible
from scheduler.topology import Topology, best_connected


class FirstFit:
    name = "first-fit"

    def place(self, snapshot: Snapshot, request: Request, explain: bool = True) -> Place | Pending:
        hosts = hosts_with_room(snapshot, request)
        if isinstance(hosts, Pending):
            return hosts
        for host in hosts:
            if request.mode == CPU_ONLY:
                return Place(request.id, host.name, ())
            grants = _fit(usable_gpus(host, request), request, host.topology)
            if grants:
                return Place(request.id, host.name, grants)
        return Pending(request.id, why_not(snapshot, request) if explain else "")


def usable_gpus(host: HostState, request: Request) -> list[GpuState]:
    """The host's GPUs in service that can take ``request``'s mode and are of a model it accepts."""
    return [
        g
        for g in host.gpus
        if g.available and g.serves(request.mode) and accessible(g.model, request.gpu_models)
    ]


def _fit(gpus: list[GpuState], request: Request, topology: Topology) -> tuple[DeviceGrant, ...]:
    if request.mode == DEDICATED:
        free = [g for g in gpus if g.idle]
        if len(free) < request.gpu_count:
            return ()
        return exclusive_grants(best_connected(free, request.gpu_count, topology))
    for gpu in gpus:
        grant = grant_on(gpu, request)
        if grant is not None:
            return (grant,)
    return ()


def _fits(host: HostState, request: Request) -> bool:
    """Whether ``_fit`` would find grants on the host's ``usable_gpus``: ``why_not`` asks it
    of every host short of CPU or memory, so it stops at the first answer."""
    mode, models = request.mode, request.gpu_models
    if mode == DEDICATED:
        wanted = request.gpu_count
        for g in host.gpus:
            if wanted > 0 and g.available and g.idle and g.serves(mode) and accessible(g.model, models):
                wanted -= 1
                if not wanted:
                    return True
        return False
    return any(
        g.available and g.serves(mode) and accessible(g.model, models) and takes(g, request)
        for g in host.gpus
    )


def serves(host: HostState, request: Request) -> bool:
    """Up, and running sandboxes at the isolation level the request asks for."""
    return host.up and (
        not request.isolation or not host.isolation_levels or request.isolation in host.isolation_levels
    )


def hosts_with_room(snapshot: Snapshot, request: Request) -> list[HostState] | Pending:
    """Up hosts of the right isolation level with the CPU and memory the sandbox needs, or
    why there are none."""
    up = [h for h in snapshot.hosts if serves(h, request)]
    if not up:
        if request.isolation and any(h.up for h in snapshot.hosts):
            return Pending(request.id, f"no GPU host that is up runs {request.isolation} sandboxes")
        return Pending(request.id, "no GPU host is up")
    if request.isolation and request.mode != CPU_ONLY and not any(h.gpus for h in up):
        # e.g. VM hosts with real GPUs, which offer none (the portal's snapshot: no passthrough)
        return Pending(request.id, f"no host that runs {request.isolation} sandboxes has a GPU to offer")
    roomy = [h for h in up if h.has_room(request.cpu_milli, request.memory_mib)]
    if not roomy:
        return Pending(
            request.id,
            f"no {'' if request.mode == CPU_ONLY else 'GPU '}host has {request.cpu_milli / 1000:g} "
            f"CPU cores and {request.memory_mib} MiB "
            "of memory free",
        )
    return roomy


def short_of_room(host: HostState, request: Request) -> bool:
    """Whether the host could take the request but for its CPU or memory (``why_not``)."""
    return (
        serves(host, request)
        and not host.has_room(request.cpu_milli, request.memory_mib)
        and (request.mode == CPU_ONLY or _fits(host, request))
    )


def short_of_room_reason(short: list[str], request: Request) -> str:
    """``why_not``'s reason when the hosts named in ``short`` are short of room (and
    nothing else matters then)."""
    return (
        f"the GPUs it needs are free on {', '.join(short)}, but without "
        f"{request.cpu_milli / 1000:g} CPU cores and {request.memory_mib} MiB of memory to spare"
    )


def room_refusal(snapshot: Snapshot, request: Request) -> Pending | None:
    """``hosts_with_room``'s answer when it finds none, else None: the first host with room
    ends the search."""
    if not request.isolation and any(
        serves(h, request) and h.has_room(request.cpu_milli, request.memory_mib) for h in snapshot.hosts
    ):
        return None
    hosts = hosts_with_room(snapshot, request)
    return hosts if isinstance(hosts, Pending) else None


def exclusive_grants(gpus: list[GpuState]) -> tuple[DeviceGrant, ...]:
    return tuple(DeviceGrant(g.uuid, g.uuid, "exclusive", 1000) for g in gpus)


def takes(gpu: GpuState, request: Request) -> bool:
    """Whether ``grant_on`` would grant the request a share of ``gpu``: what a search over
    many hosts asks, without building the grant."""
    if request.mode == MPS:
        return _mps_fits(gpu, request)
    if request.mode == TIMESLICE:
        return any(r not in gpu.replicas_used for r in range(gpu.replicas))
    return grant_on(gpu, request) is not None


def _mps_fits(gpu: GpuState, request: Request) -> bool:
    return (
        gpu.mps_used_mib + request.mps_memory_mib <= gpu.memory_mib
        and gpu.mps_used_threads + request.mps_thread_pct <= 100
        and not (
            gpu.mps_one_size and gpu.mps_share not in (None, (request.mps_memory_mib, request.mps_thread_pct))
        )
    )


def grant_on(gpu: GpuState, request: Request) -> DeviceGrant | None:
    """The share of ``gpu`` a MIG, MPS or time-slice request would get, if it fits."""
    if request.mode == MIG:
        for slot in gpu.mig:
            if not slot.busy and slot.profile == request.mig_profile:
                model = MODELS.get(gpu.model)
                compute = model.profile(slot.profile).compute_slices if model else 1
                milli = compute * 1000 // COMPUTE_SLICES
                return DeviceGrant(gpu.uuid, slot.uuid, "mig", milli, mig_uuid=slot.uuid)
    elif request.mode == MPS:
        if _mps_fits(gpu, request):
            return DeviceGrant(
                gpu.uuid,
                gpu.uuid,
                "mps",
                max(1, request.mps_thread_pct * 10),
                mps_memory_mib=request.mps_memory_mib,
                mps_thread_pct=request.mps_thread_pct,
            )
    elif request.mode == TIMESLICE:
        free_replicas = [r for r in range(gpu.replicas) if r not in gpu.replicas_used]
        if free_replicas:
            milli = 1000 // max(1, gpu.replicas)
            return DeviceGrant(gpu.uuid, gpu.uuid, "timeslice", milli, replica=free_replicas[0])
    return None


def why_not(snapshot: Snapshot, request: Request) -> str:
    """A reason a person can act on: what kind of capacity is missing.

    One pass over the hosts, the GPUs looked at once each: the cycle asks this for every
    request shape that waits, on fleets of thousands of hosts.
    """
    mode, models = request.mode, request.gpu_models
    short: list[str] = []  # hosts where the GPUs fit but the CPU or memory does not
    offering = accepted = in_service = has_profile = one_size = False
    most = 0  # the most idle GPUs a dedicated request could have on one host
    for host in snapshot.hosts:
        if short_of_room(host, request):
            short.append(host.name)
        if short or mode == CPU_ONLY or not serves(host, request):
            continue  # a host short of room is the reason: what the GPUs offer no longer matters
        idle = 0
        for g in host.gpus:
            if not g.could_serve(mode):  # pinned to another mode, or MIG asked of a GPU not in it
                continue
            offering = True
            one_size = one_size or g.mps_one_size
            in_service = in_service or g.available
            if models and not accessible(g.model, models):
                continue
            accepted = True
            if mode == DEDICATED and g.available and g.idle and g.serves(mode):
                idle += 1
            elif mode == MIG and not has_profile:
                has_profile = any(s.profile == request.mig_profile for s in g.mig)
        most = max(most, idle)
    if short:
        return short_of_room_reason(short, request)
    if mode == CPU_ONLY:
        return (
            f"no host has {request.cpu_milli / 1000:g} CPU cores and {request.memory_mib} MiB of memory free"
        )
    if not offering:
        return f"no GPU in the fleet offers {mode} sharing"
    if models and not accepted:
        return f"no GPU of model {' or '.join(models)} offers {mode} sharing"
    if not in_service:
        return f"every {mode} GPU is drained or unavailable"
    if mode == DEDICATED:
        noun = "GPU" if request.gpu_count == 1 else "GPUs"
        return f"waiting for {request.gpu_count} free {noun} on one host (at most {most} free now)"
    if mode == MIG:
        if not has_profile:
            return f"no MIG instance of profile {request.mig_profile} exists in the fleet"
        return f"every {request.mig_profile} MIG slice is in use"
    if request.mode == MPS:
        said = f"no MPS GPU has {request.mps_memory_mib} MiB and {request.mps_thread_pct}% threads free"
        return said + (
            " beside shares of that size (an MPS GPU serves shares of one size)" if one_size else ""
        )
    return "every time-slice replica is in use"
