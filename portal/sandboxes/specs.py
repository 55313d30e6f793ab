"""Turning a placed sandbox into the self-contained launch message an agent executes."""

from __future__ import annotations

from portal.catalog.models import ImageRegistry, Tier
from portal.catalog.storage import mounts_for
from portal.fleet.models import GpuMode
from portal.sandboxes import resume
from portal.sandboxes.models import Allocation, Sandbox
from portal.sandboxes.reach import app_token
from wire.spec import MemoryShare, MpsShare, SandboxSpec


def launch_spec(sandbox: Sandbox) -> SandboxSpec:
    assert sandbox.host is not None  # noqa: S101 - only placed sandboxes are launched
    # Empty for a CPU-only sandbox: no device, and no NVIDIA device request (real_gpu).
    allocations = list(sandbox.allocations.filter(active=True).select_related("gpu").order_by("gpu__index"))
    mps = None
    mps_alloc = next((a for a in allocations if a.kind == Allocation.Kind.MPS), None)
    if mps_alloc is not None:
        # The agent fills in its control daemon's pipe directory for this GPU.
        mps = MpsShare(pipe_dir="", thread_pct=mps_alloc.mps_thread_pct, memory_mib=mps_alloc.mps_memory_mib)
    tier = sandbox.tier
    # On a Slurm node the storage is the cluster's own file systems, which gpushare neither
    # mounts nor writes: no folder it could promise there.
    folder = "" if sandbox.host.slurm_node else resume.checkpoint_dir(tier, sandbox)
    return SandboxSpec(
        allocation_key=sandbox.allocation_key,
        sandbox_id=sandbox.pk,
        host=sandbox.host.name,
        project=sandbox.project.slug,
        owner=sandbox.owner.get_username(),
        owner_id=sandbox.owner_id,
        image=sandbox.image.reference,
        command=tuple(sandbox.command if sandbox.batch else sandbox.image.command or ("sleep", "infinity")),
        device_uuids=tuple(a.device_uuid for a in allocations),
        real_gpu=bool(allocations) and not sandbox.host.simulated,
        cpu_limit=tier.cpu_limit,
        memory_limit_mib=tier.memory_limit_mib,
        pids_limit=tier.pids_limit,
        shm_size_mib=tier.shm_mib,
        network=tier.network,
        mps=mps,
        # Pinned to MPS, the GPU's daemon may outlive its last share; following demand, not.
        mps_pinned=mps_alloc is not None and mps_alloc.gpu.sharing_mode == GpuMode.MPS,
        isolation=sandbox.isolation,
        env={
            "GPUSHARE_SANDBOX_ID": str(sandbox.pk),
            "GPUSHARE_PROJECT": sandbox.project.slug,
            **resume.resume_env(sandbox, folder),
            # The app is served at the root of an origin of its own; it asks for its token
            # (the proxy sends it with every request the owner's app session lets through).
            **(
                {"GPUSHARE_APP_URL": "/", "GPUSHARE_APP_TOKEN": app_token(sandbox.allocation_key)}
                if sandbox.image.app
                else {}
            ),
        },
        tier=tier.slug,
        batch=sandbox.batch,
        mounts=mounts_for(tier, sandbox.owner, sandbox.project),
        app=bool(sandbox.image.app),
        pull=ImageRegistry.allows(sandbox.image.reference),
        memory_share=memory_share(tier, allocations),
    )


def memory_share(tier: Tier, allocations: list[Allocation]) -> MemoryShare | None:
    """What a sandbox on a shared GPU may hold of its device's memory, all its processes
    together, and what its tier does when it holds more; None on a GPU of its own (whole or a
    MIG instance, whose memory the hardware bounds) and for CPU-only sandboxes.

    An MPS share's memory is what it asked for (the pinned limit binds each process, not the
    sandbox). A time-slice replica reserves nothing on the device, so its fair part is the
    GPU's memory over the replicas it is cut into: what the page shows as its share."""
    shared = next(
        (a for a in allocations if a.kind in (Allocation.Kind.MPS, Allocation.Kind.TIMESLICE)), None
    )
    if shared is None:
        return None
    over_share, grace_s = str(tier.over_share), int(tier.over_share_grace.total_seconds())
    if shared.kind == Allocation.Kind.MPS:
        return MemoryShare("mps", shared.mps_memory_mib, over_share=over_share, grace_s=grace_s)
    replicas = max(1, shared.gpu.timeslice_replicas)
    return MemoryShare(
        "timeslice", shared.gpu.memory_mib // replicas, replicas, over_share=over_share, grace_s=grace_s
    )
