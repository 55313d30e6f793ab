"""A GPU's sharing mode: following demand, or pinned by an admin; and what it serves now.

A non-MIG GPU follows demand (``GpuMode.AUTO``) unless an admin pins it to dedicated, MPS
or time-slice. Following demand, an idle GPU takes whichever of those the scheduler
places on it and serves that mode until the last sandbox of it leaves. A GPU in MIG mode
stays ``mig``: leaving MIG mode needs a GPU reset, and its slices change only through
re-layout plans (``portal.control.plans``).

``do_set_gpu_mode`` is the one writer of a GPU's mode (the console's fleet page and the
Django admin call it). Pinning is refused while the GPU holds sandboxes of another mode:
the pin would promise what is not true until they end. The GPU's agent is told after
commit, so it can stop an MPS daemon that no pinned MPS GPU keeps up any more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.db.models import Max

from portal.fleet.models import SETTABLE_MODES, FleetEvent, Gpu, GpuMode
from wire.messages import to_host

log = logging.getLogger(__name__)

# The mode an allocation of each kind (``Allocation.Kind``) puts its GPU in.
KIND_MODE: dict[str, str] = {
    "exclusive": GpuMode.DEDICATED,
    "mig": GpuMode.MIG,
    "mps": GpuMode.MPS,
    "timeslice": GpuMode.TIMESLICE,
}
# How each mode reads in a sentence ("pinned: MPS", "follows demand — now time-slice").
MODE_WORDS: dict[str, str] = {
    GpuMode.DEDICATED: "dedicated",
    GpuMode.MIG: "MIG",
    GpuMode.MPS: "MPS",
    GpuMode.TIMESLICE: "time-slice",
}


def most_replicas() -> int | None:
    """The most time-slice replicas a GPU of the fleet is cut into (None: no GPU may be
    time-sliced): a request does not know its GPU yet, and shares it with at most this
    many less one."""
    most: int | None = (
        Gpu.objects.filter(mig_enabled=False, sharing_mode__in=(GpuMode.AUTO, GpuMode.TIMESLICE))
        .aggregate(most=Max("timeslice_replicas"))
        .get("most")
    )
    return most


class GpuModeError(Exception):
    """A mode change that cannot be made, said so that an admin knows what to do."""


def serving(mode: str, held_kinds: Iterable[str]) -> str:
    """The mode a GPU serves now: its pinned one (or MIG); following demand, that of the
    allocations it holds (``held_kinds``), or AUTO while it is idle."""
    if mode != GpuMode.AUTO:
        return mode
    return next((KIND_MODE[kind] for kind in held_kinds if kind in KIND_MODE), GpuMode.AUTO)


def describe(mode: str, held_kinds: Iterable[str]) -> str:
    """The fleet page's words for a GPU's mode: "follows demand — now idle", "follows demand
    — now MPS", "pinned: MPS" or "MIG"."""
    if mode == GpuMode.MIG:
        return "MIG"
    if mode != GpuMode.AUTO:
        return f"pinned: {MODE_WORDS[mode]}"
    now = serving(mode, held_kinds)
    return f"follows demand — now {'idle' if now == GpuMode.AUTO else MODE_WORDS[now]}"


def check_gpu_mode(gpu: Gpu, mode: str) -> None:
    """Raise GpuModeError unless ``gpu`` may be set to ``mode`` now."""
    if gpu.mig_enabled:
        raise GpuModeError(
            f"{gpu} is in MIG mode: its slices change through a MIG re-layout plan, and leaving "
            "MIG mode needs a GPU reset on its host."
        )
    if mode not in SETTABLE_MODES:
        allowed = ", ".join(str(m.label).lower() for m in SETTABLE_MODES)
        raise GpuModeError(f"A GPU not in MIG mode either follows demand or is pinned: {allowed}.")
    if mode == GpuMode.AUTO:
        return  # whatever it holds is one mode, which a GPU following demand may serve
    held = list(gpu.allocations.filter(active=True).values_list("kind", flat=True))
    other = sorted({KIND_MODE[kind] for kind in held} - {mode})
    if other:
        words = " and ".join(MODE_WORDS[m] for m in other)
        raise GpuModeError(
            f"{gpu} holds {len(held)} {words} sandbox{'es' if len(held) > 1 else ''}: it can be "
            f"pinned to {MODE_WORDS[mode]} once they have stopped (drain it meanwhile so that no "
            "new ones start)."
        )


def do_set_gpu_mode(uuid: str, mode: str, actor: Any = None) -> Gpu:
    """Pin a GPU to ``mode``, or let it follow demand again (``GpuMode.AUTO``).

    The GPU row is locked first, as ``actions._claim_devices`` locks it before booking, so
    no placement lands between the check of what the GPU holds and the change. Writes a
    fleet event (the audit log records the change of an admin's request by itself) and
    tells the GPU's agent after commit. Raises GpuModeError; idempotent.
    """
    with transaction.atomic():
        gpu = Gpu.objects.select_for_update().select_related("host").filter(uuid=uuid).first()
        if gpu is None:
            raise GpuModeError(f"No GPU {uuid}.")
        check_gpu_mode(gpu, mode)
        if gpu.sharing_mode == mode:
            return gpu
        before = gpu.sharing_mode
        gpu.sharing_mode = mode
        gpu.save(update_fields=["sharing_mode"])
        message = (
            "follows demand" if mode == GpuMode.AUTO else f"pinned to {MODE_WORDS[mode]}"
        ) + f" (was {GpuMode(before).label.lower()})"
        FleetEvent.objects.create(
            host=gpu.host,
            gpu=gpu,
            kind="mode",
            message=message,
            actor=actor if getattr(actor, "is_authenticated", False) else None,
        )
        host_name = gpu.host.name
        transaction.on_commit(lambda: to_host(host_name).gpu_mode(uuid, mode))
    log.info("GPU %s %s", uuid, message)
    return gpu
