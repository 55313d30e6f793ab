"""Turning the trace's pods into sandbox requests, the way a user or the API makes them:
the request form (``SandboxRequestForm``, which the API's create goes through too) and
``do_request_sandbox``; and reading back what the control plane decided for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction

from portal.fleet.models import Host
from portal.sandboxes import actions
from portal.sandboxes.forms import SandboxRequestForm
from portal.sandboxes.models import Allocation, Sandbox, SandboxState
from portal.twin.population import Population
from scheduler.research.trace import PodSpec


class TwinError(Exception):
    """The twin cannot go on: a refused request, a stalled control plane."""


@dataclass(frozen=True)
class Placement:
    seq: int
    host: str  # "" when no host took it
    gpus: tuple[int, ...]  # GPU indices on the host
    milli: tuple[int, ...]  # per GPU: the milli-GPU granted


def request_pods(
    population: Population, pods: list[tuple[int, PodSpec]], duration: Callable[[PodSpec], timedelta]
) -> dict[int, int]:
    """Request ``pods`` (``(seq, pod)`` each) in one transaction, so the scheduling cycle sees
    them together, as the replay's batch: sandbox id -> seq."""
    ids: dict[int, int] = {}
    with transaction.atomic():
        for seq, pod in pods:
            user, _ = population.member(seq)
            form = SandboxRequestForm(
                population.form_data(seq, pod, duration(pod)), user=user, for_create=True
            )
            if not form.is_valid() or form.request_obj is None:
                raise TwinError(
                    f"pod {pod.name} (seq {seq}) refused by the request form: {form.errors.as_json()}"
                )
            try:
                sandbox = actions.do_request_sandbox(user, form.request_obj)
            except actions.SandboxRequestError as exc:
                raise TwinError(f"pod {pod.name} (seq {seq}) refused: {exc.field}: {exc.message}") from exc
            ids[sandbox.pk] = seq
    return ids


def wait_decided(ids: list[int], timeout_s: float, is_alive: Callable[[], list[str]]) -> None:
    """Until a cycle has decided every one of ``ids``: placed on a host, or waiting with a
    reason. A cycle commits its decisions at once, so none is seen half decided."""
    deadline = time.monotonic() + timeout_s
    while True:
        undecided = Sandbox.objects.filter(
            pk__in=ids, state=SandboxState.QUEUED, host__isnull=True, pending_reason=""
        ).count()
        if not undecided:
            return
        if dead := is_alive():
            raise TwinError(f"a twin process exited: {', '.join(dead)}")
        if time.monotonic() > deadline:
            raise TwinError(
                f"{undecided} requests undecided after {timeout_s:.0f} s: is the control worker up?"
            )
        time.sleep(0.05)


def give_up_waiting(ids: list[int], population: Population, reason: str) -> list[int]:
    """Stop, as their owners, those of ``ids`` still queued; returns them."""
    waiting = list(
        Sandbox.objects.filter(pk__in=ids, state=SandboxState.QUEUED).values_list("pk", "owner_id")
    )
    for sandbox_id, owner_id in waiting:
        actions.do_request_stop(sandbox_id, population.owner(owner_id), reason)
    return [sandbox_id for sandbox_id, _ in waiting]


def placements(ids: dict[int, int]) -> list[Placement]:
    """Where the sandboxes of ``ids`` (id -> seq) went, from the database's rows."""
    hosts = dict(Host.objects.values_list("pk", "name"))
    grants: dict[int, list[tuple[int, int]]] = {}
    for sandbox_id, index, milli in (
        Allocation.objects.filter(sandbox_id__in=list(ids))
        .order_by("sandbox_id", "gpu__index")
        .values_list("sandbox_id", "gpu__index", "milli_gpu")
    ):
        grants.setdefault(sandbox_id, []).append((index, milli))
    out = []
    for sandbox_id, host_id in Sandbox.objects.filter(pk__in=list(ids)).values_list("pk", "host_id"):
        held = grants.get(sandbox_id, [])
        out.append(
            Placement(
                ids[sandbox_id],
                hosts[host_id] if host_id is not None else "",
                tuple(i for i, _ in held),
                tuple(m for _, m in held),
            )
        )
    return sorted(out, key=lambda p: p.seq)
