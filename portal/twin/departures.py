"""A twin run with departures: a window of the trace replayed on its own clock.

Each pod of the window is requested at its creation time and stopped at its deletion
time, ``speed`` trace seconds passing per wall second; pods already running when the
window opens are requested at once. Requests due together go in one transaction. A pod
still waiting when it is deleted is withdrawn (its owner stops it), as the trace's pod
was deleted. What the trace gives is used as it is: no clones, no tuning.

Queue waits are measured on the wall clock (requested to placed, as the database has
them) and given in trace time too (x ``speed``): a cycle's two seconds are ``2 x speed``
seconds of trace time, the floor of any wait in accelerated time.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings

from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from portal.twin import arrivals, report
from portal.twin.monitor import database_bytes
from portal.twin.run import RunOptions, Twin, refuse_model_constraints
from scheduler.research.trace import PodSpec, load_nodes, load_pod_times, load_pods

log = logging.getLogger(__name__)
ARRIVE, DEPART = 1, 0  # at the same instant a departure goes first: it frees what arrivals need
MAX_HOURS = 720  # the request form's longest duration
CLASSES = ("share", "one GPU", "multi-GPU", "CPU-only")


@dataclass(frozen=True)
class DepartureOptions(RunOptions):
    days: float = 7.0
    speed: float = 336.0  # a week in 30 minutes
    start_day: float | None = None  # default: the last ``days`` of the trace


def request_class(pod: PodSpec) -> str:
    if not (pod.num_gpu and pod.gpu_milli):
        return "CPU-only"
    if pod.sharing:
        return "share"
    return "one GPU" if pod.num_gpu == 1 else "multi-GPU"


def schedule(
    pods: list[PodSpec], times: dict[str, tuple[int, int]], start_s: float, end_s: float, speed: float
) -> list[tuple[float, int, int]]:
    """(wall second, ARRIVE or DEPART, pod index) for the window's pods, in order."""
    events: list[tuple[float, int, int]] = []
    for index, pod in enumerate(pods):
        created, deleted = times[pod.name]
        if deleted <= start_s or created >= end_s:
            continue
        events.append((max(0.0, (created - start_s) / speed), ARRIVE, index))
        if deleted < end_s:
            events.append(((deleted - start_s) / speed, DEPART, index))
    heapq.heapify(events)
    return [heapq.heappop(events) for _ in range(len(events))]


def run_with_departures(options: DepartureOptions) -> dict[str, Any]:
    nodes = load_nodes(options.nodes)
    pods = sorted(load_pods(options.pods), key=lambda p: p.name)
    times = load_pod_times(options.pods)
    refuse_model_constraints(pods)
    last = max(created for created, _ in times.values())
    start_s = options.start_day * 86400 if options.start_day is not None else last - options.days * 86400
    end_s = start_s + options.days * 86400
    events = schedule(pods, times, start_s, end_s, options.speed)
    window = sorted({index for _, kind, index in events if kind == ARRIVE})
    summary: dict[str, Any] = {
        "mode": "departures", "days": options.days, "speed": options.speed,
        "window_days": [round(start_s / 86400, 3), round(end_s / 86400, 3)],
        "pods": len(window), "departures": sum(1 for _, kind, _ in events if kind == DEPART),
    }  # fmt: skip
    with Twin(options.out, nodes, [pods[i] for i in window], options.projects) as twin:
        summary.update(twin.describe())
        database_before = database_bytes()
        ids, withdrawn = _play(twin, pods, times, events, options.speed)
        summary["feasibility_problems"] = report.feasibility_problems(nodes)
        summary["plans"] = report.plans_run()
        summary["rollups"] = report.rollups_kept(twin.gpus)
        summary.update(twin.control_figures())
        database_growth = database_bytes() - database_before
    summary["database_mib_per_trace_day"] = round(database_growth / 2**20 / options.days, 2)
    summary["samples"] = twin.monitor.rows()
    running_at_start = {i for i in window if times[pods[i].name][0] < start_s}
    summary["queue_wait"] = _waits(
        {k: i for k, i in ids.items() if i not in running_at_start}, pods, options.speed
    )
    # Already running when the window opens: requested together before the run's first cycle.
    summary["queue_wait_of_those_running_at_start"] = _waits(
        {k: i for k, i in ids.items() if i in running_at_start}, pods, options.speed
    )
    summary["withdrawn_while_waiting"] = len(withdrawn)
    # At this speed a cycle every CYCLE_INTERVAL_S wall seconds is this many trace seconds:
    # a pod deleted sooner is often withdrawn before any cycle saw it.
    cycle_trace_s = settings.CYCLE_INTERVAL_S * options.speed
    summary["pods_living_less_than_a_cycle"] = sum(
        1 for i in window if times[pods[i].name][1] - times[pods[i].name][0] < cycle_trace_s
    )
    report.write_summary(options.out, summary)
    return summary


def _play(
    twin: Twin,
    pods: list[PodSpec],
    times: dict[str, tuple[int, int]],
    events: list[tuple[float, int, int]],
    speed: float,
) -> tuple[dict[int, int], list[int]]:
    """Carry out the events on the wall clock: sandbox id -> pod index, and those withdrawn."""
    ids: dict[int, int] = {}
    sandbox_of: dict[int, int] = {}
    withdrawn: list[int] = []
    began = time.monotonic()
    at = 0
    reported = 0.0
    while at < len(events):
        due = events[at][0]
        wait = due - (time.monotonic() - began)
        if wait > 0:
            time.sleep(wait)
        if dead := twin.services.dead():
            raise arrivals.TwinError(f"a twin process exited: {', '.join(dead)}")
        now = time.monotonic() - began
        batch: list[tuple[int, PodSpec]] = []
        while at < len(events) and events[at][0] <= now:
            _, kind, index = events[at]
            at += 1
            if kind == ARRIVE:
                batch.append((index, pods[index]))
                continue
            if batch:  # arrivals first that came before this departure
                _arrive(twin, batch, times, speed, ids, sandbox_of)
                batch = []
            withdrawn += _depart(twin, sandbox_of.get(index))
        if batch:
            _arrive(twin, batch, times, speed, ids, sandbox_of)
        if now - reported >= 60:
            reported = now
            log.warning("twin: %.1f trace days in, %d requested", now * speed / 86400, len(ids))
    return ids, withdrawn


def _arrive(
    twin: Twin,
    batch: list[tuple[int, PodSpec]],
    times: dict[str, tuple[int, int]],
    speed: float,
    ids: dict[int, int],
    sandbox_of: dict[int, int],
) -> None:
    def duration(pod: PodSpec) -> timedelta:
        created, deleted = times[pod.name]
        hours = math.ceil(max(1.0, (deleted - created) / speed) / 3600)
        return timedelta(hours=min(MAX_HOURS, max(1, hours)))

    requested = arrivals.request_pods(twin.population, batch, duration)
    ids.update(requested)
    sandbox_of.update({index: sandbox_id for sandbox_id, index in requested.items()})


def _depart(twin: Twin, sandbox_id: int | None) -> list[int]:
    """Stop the pod's sandbox as its owner; returns it if it was still waiting."""
    if sandbox_id is None:
        return []
    state, owner = Sandbox.objects.values_list("state", "owner_id").get(pk=sandbox_id)
    waiting = state == "queued"
    actions.do_request_stop(sandbox_id, twin.population.owner(owner), "the trace's pod was deleted")
    return [sandbox_id] if waiting else []


def _waits(ids: dict[int, int], pods: list[PodSpec], speed: float) -> dict[str, Any]:
    """Queue wait percentiles per request class, wall seconds and trace seconds."""
    by_class: dict[str, list[float]] = {name: [] for name in CLASSES}
    never: dict[str, int] = dict.fromkeys(CLASSES, 0)
    for sandbox_id, requested_at, placed_at in Sandbox.objects.filter(pk__in=list(ids)).values_list(
        "pk", "requested_at", "placed_at"
    ):
        name = request_class(pods[ids[sandbox_id]])
        if placed_at is None:
            never[name] += 1
        else:
            by_class[name].append((placed_at - requested_at).total_seconds())
    return {
        name: {
            "wall_s": report.spread(values),
            "trace_s": report.spread([v * speed for v in values]),
            "never_placed": never[name],
        }
        for name, values in by_class.items()
    }
