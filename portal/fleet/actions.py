"""Every host and GPU state change: the one writer of ``Host.state`` and ``Gpu.state``.

As ``portal.sandboxes.actions`` is for sandboxes: a change not in the transition table is
refused (``FleetTransitionError``), and each change writes a ``FleetEvent`` in the same
transaction, so the fleet's history says when a host was lost and came back, and when a
GPU was drained, undrained, went missing or came back.

The callers hold the rows' locks (``select_for_update``) and decide *whether* to change
(a silent host, a GPU fault, an admin's drain, an agent's inventory); what follows from a
change for sandboxes (lost with their host, owners told of a drain) is the control layer's
(``portal.control``), above this app.

A change a signed-in person made (an admin's drain or undrain) also goes in the audit
trail, with the values before and after: the update skips model signals, so it is recorded
here, explicitly.

Host states: ``up`` (its agent beats), ``lost`` (it missed heartbeats), ``draining`` (in
the table, set by nothing yet). GPU states: ``available``, ``drained`` (out of service
until an admin undrains it: a fault or an admin's drain), ``unavailable`` (its host is
lost, its agent no longer sees it, or its agent sees it but cannot offer it: an NVLink
fabric Fabric Manager has not registered). Unavailability ends by itself, when the agent
offers the GPU again; the reason is kept with the GPU meanwhile (``unavailable_reason``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.utils import timezone

from portal.audit import trail
from portal.fleet.models import FleetEvent, Gpu, Host

log = logging.getLogger(__name__)
H = Host.State
G = Gpu.State

# Allowed transitions; anything else is refused rather than written.
HOST_TRANSITIONS: dict[str, set[str]] = {
    H.UP: {H.LOST, H.DRAINING},
    H.DRAINING: {H.UP, H.LOST},
    H.LOST: {H.UP},  # it beats again
}
GPU_TRANSITIONS: dict[str, set[str]] = {
    G.AVAILABLE: {G.DRAINED, G.UNAVAILABLE},
    # A fault reported for a GPU while it is unavailable still takes it out of service.
    G.UNAVAILABLE: {G.AVAILABLE, G.DRAINED},
    # Only an admin's undrain: a drained GPU that vanishes and comes back stays drained
    # (its fault is not repaired by the host losing it), so it is never made unavailable.
    G.DRAINED: {G.AVAILABLE},
}
# The fleet event kind of each host transition (from, to).
HOST_EVENTS: dict[tuple[str, str], str] = {
    (H.UP, H.LOST): "host_lost",
    (H.DRAINING, H.LOST): "host_lost",
    (H.LOST, H.UP): "host_regained",
    (H.UP, H.DRAINING): "host_draining",
    (H.DRAINING, H.UP): "host_undrained",
}
# The fleet event kind of each GPU transition (from, to); a drain's is its cause's
# ("drained" by hand, or the fault: "xid", "ecc_dbe", "gpu_lost", "overheat").
GPU_EVENTS: dict[tuple[str, str], str] = {
    (G.AVAILABLE, G.DRAINED): "drained",
    (G.UNAVAILABLE, G.DRAINED): "drained",
    (G.DRAINED, G.AVAILABLE): "undrained",
    (G.AVAILABLE, G.UNAVAILABLE): "unavailable",
    (G.UNAVAILABLE, G.AVAILABLE): "available",
}


class FleetTransitionError(ValueError):
    """A host or GPU state change that the transition table does not allow."""


def _user(actor: Any) -> Any:
    return actor if getattr(actor, "is_authenticated", False) else None


def _check(table: dict[str, set[str]], what: str, current: str, to: str) -> None:
    if to not in table.get(current, set()):
        raise FleetTransitionError(f"{what}: {current} -> {to} is not a transition")


def _host_to(host: Host, to: str, message: str, actor: Any = None) -> FleetEvent:
    """Move a locked host to ``to`` and write its event. Caller holds the row lock."""
    _check(HOST_TRANSITIONS, f"host {host.name}", host.state, to)
    event = FleetEvent.objects.create(
        host=host, kind=HOST_EVENTS[(host.state, to)], message=message[:300], actor=_user(actor)
    )
    log.info("host %s: %s -> %s: %s", host.name, host.state, to, message)
    if _user(actor) is not None:  # a person's change is an admin change: the audit trail's
        trail.record(actor, event.kind, host, {"state": host.state}, {"state": to}, message)
    host.state = to
    host.save(update_fields=["state"])
    return event


def _gpus_to(
    gpus: Iterable[Gpu],
    to: str,
    message: str,
    *,
    kind: str = "",
    reason: str | None = None,
    actor: Any = None,
) -> list[Gpu]:
    """Move locked GPUs to ``to``, one UPDATE and one event each (written together).

    ``reason``: the reason stored with a drain or with unavailability; leaving ``drained``
    or ``unavailable`` clears it.
    ``kind``: the event's kind when not the table's (a drain's cause). Every transition is
    checked before anything is written. Returns the GPUs changed (those already in ``to``
    are left, as a repeated report changes nothing)."""
    moving = [gpu for gpu in gpus if gpu.state != to]
    for gpu in moving:
        _check(GPU_TRANSITIONS, f"GPU {gpu.uuid}", gpu.state, to)
    if not moving:
        return []
    now = timezone.now()
    FleetEvent.objects.bulk_create(
        FleetEvent(
            at=now,
            host_id=gpu.host_id,
            gpu=gpu,
            kind=kind or GPU_EVENTS[(gpu.state, to)],
            message=message[:300],
            actor=_user(actor),
        )
        for gpu in moving
    )
    fields: dict[str, Any] = {"state": to}
    if to == G.DRAINED:
        fields["drain_reason"] = (reason or "")[:200]
    elif any(gpu.state == G.DRAINED for gpu in moving):
        fields["drain_reason"] = ""
    if to == G.UNAVAILABLE:
        fields["unavailable_reason"] = (reason or "")[:200]
    elif any(gpu.state == G.UNAVAILABLE for gpu in moving):
        fields["unavailable_reason"] = ""
    Gpu.objects.filter(pk__in=[gpu.pk for gpu in moving]).update(**fields)
    person = _user(actor)
    for gpu in moving:
        before = {name: getattr(gpu, name) for name in fields}
        for name, value in fields.items():
            setattr(gpu, name, value)
        if person is not None:  # a person's change is an admin change: the audit trail's
            trail.record(person, kind or GPU_EVENTS[(before["state"], to)], gpu, before, fields, message)
    return moving


# --- hosts --------------------------------------------------------------------------------


def lose_host(host: Host, message: str) -> list[Gpu]:
    """A locked host is lost: its available GPUs become unavailable (a drained one stays
    drained). Returns the GPUs made unavailable."""
    _host_to(host, H.LOST, message)
    gpus = list(Gpu.objects.select_for_update().filter(host=host, state=G.AVAILABLE))
    return _gpus_to(
        gpus, G.UNAVAILABLE, f"unavailable: host {host.name} lost", reason=f"host {host.name} lost"
    )


def regain_host(host: Host, message: str = "heartbeats again") -> None:
    """A locked lost host is back up. Its GPUs stay unavailable until its agent's inventory
    says which are really there (``portal.fleet.inventory``)."""
    _host_to(host, H.UP, message)


# --- GPUs ---------------------------------------------------------------------------------


def drain_gpu(gpu: Gpu, reason: str, message: str, *, kind: str = "", actor: Any = None) -> bool:
    """Take a locked GPU out of service; ``kind``: the fault's, or "drained" by hand.
    False when it was drained already."""
    return bool(_gpus_to([gpu], G.DRAINED, message, kind=kind, reason=reason, actor=actor))


def undrain_gpu(gpu: Gpu, actor: Any = None, message: str = "undrained") -> bool:
    """Return a locked drained GPU to service. False when it was not drained."""
    if gpu.state != G.DRAINED:
        return False
    return bool(_gpus_to([gpu], G.AVAILABLE, message, actor=actor))


def gpus_unavailable(
    gpus: Iterable[Gpu], message: str, reason: str = "its agent no longer sees it"
) -> list[Gpu]:
    """Locked available GPUs no longer there (their agent does not see them). A drained
    GPU stays drained; one unavailable already is left. Returns those changed."""
    return _gpus_to([gpu for gpu in gpus if gpu.state == G.AVAILABLE], G.UNAVAILABLE, message, reason=reason)


def gpu_not_ready(gpu: Gpu, reason: str) -> bool:
    """A locked GPU its agent sees but cannot offer, for ``reason`` (its NVLink fabric is
    not ready): an available one becomes unavailable with it; an unavailable one takes it
    as its reason (it is there, and this is why it is not offered); a drained one stays
    drained, as only an admin undrains. True when the state changed."""
    if gpu.state == G.AVAILABLE:
        return bool(_gpus_to([gpu], G.UNAVAILABLE, f"unavailable: {reason}", reason=reason))
    if gpu.state == G.UNAVAILABLE and gpu.unavailable_reason != reason[:200]:
        gpu.unavailable_reason = reason[:200]
        gpu.save(update_fields=["unavailable_reason"])
    return False


def gpus_available(gpus: Iterable[Gpu], message: str) -> list[Gpu]:
    """Locked GPUs seen again by their agent (a host's, back from lost): the unavailable ones
    become available, one UPDATE for all. A drained one stays drained. Returns those changed."""
    return _gpus_to([gpu for gpu in gpus if gpu.state == G.UNAVAILABLE], G.AVAILABLE, message)
