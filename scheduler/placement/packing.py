"""The live cycle's default policy, ``gpushare``: fragmentation-aware best fit.

First fit takes the first device that fits, which spreads small shares over many GPUs
and breaks up hosts that a multi-GPU request will later need whole. This policy packs:

- dedicated: the host that keeps the fewest idle GPUs after the placement (best fit), so
  hosts with many idle GPUs stay whole for large requests;
- MIG: the GPU with the fewest free slots left afterwards (fill partly used GPUs first);
- MPS: the GPU left with the least free threads, then the least free memory;
- time-slice: the GPU with the fewest free replicas left.

Ties go to host name and GPU index, so decisions are deterministic.
"""

from __future__ import annotations

from scheduler.cluster import DEDICATED, MIG, MPS, DeviceGrant, GpuState, Pending, Place, Request, Snapshot
from scheduler.placement.firstfit import exclusive_grants, grant_on, hosts_with_room, why_not


class PackingPolicy:
    name = "gpushare"

    def place(self, snapshot: Snapshot, request: Request) -> Place | Pending:
        hosts = hosts_with_room(snapshot, request)
        if isinstance(hosts, Pending):
            return hosts
        best: tuple[tuple[int, int, str, int], str, tuple[DeviceGrant, ...]] | None = None
        for host in hosts:
            gpus = [g for g in host.gpus if g.available and g.mode == request.mode]
            if request.mode == DEDICATED:
                idle = [g for g in gpus if g.idle]
                if len(idle) >= request.gpu_count:
                    key = (len(idle) - request.gpu_count, 0, host.name, 0)
                    if best is None or key < best[0]:
                        best = (key, host.name, exclusive_grants(idle[: request.gpu_count]))
                continue
            for gpu in gpus:
                grant = grant_on(gpu, request)
                if grant is not None:
                    key = (*_slack(gpu, request), host.name, gpu.index)
                    if best is None or key < best[0]:
                        best = (key, host.name, (grant,))
        if best is None:
            return Pending(request.id, why_not(snapshot, request))
        return Place(request.id, best[1], best[2])


def _slack(gpu: GpuState, request: Request) -> tuple[int, int]:
    """What stays free on ``gpu`` after the placement: less is a tighter fit."""
    if request.mode == MIG:
        return sum(1 for s in gpu.mig if not s.busy) - 1, 0
    if request.mode == MPS:
        threads_left = 100 - gpu.mps_used_threads - request.mps_thread_pct
        return threads_left, gpu.memory_mib - gpu.mps_used_mib - request.mps_memory_mib
    return gpu.replicas - len(gpu.replicas_used) - 1, 0
