"""GPU faults: which take the GPU out of service, which are a tenant's own bug; one alert each.

A device fault (a device XID, a double-bit ECC error, a GPU lost, a GPU over the
temperature rule) goes to the control worker, which drains the GPU, and raises one alert
for the GPU. An application XID (the tenant's kernel faulted: NVIDIA's device plugin
ignores these, the GPU is healthy) drains nothing: it raises one alert for the sandboxes
on the device that faulted, and their owners hear of it.

A GPU's memory repair state (a failed or pending row remap, pages waiting for retirement:
``workers.host.memory_repairs``) is read at start and on a period, and drains the same way.

On a device MPS shares run on, an application XID is not one sandbox's bug: NVIDIA's MPS
delivers a fatal fault in one client to every client of the GPU's server (see
workers.gpu.mps_recovery). Every share on the device is told that its CUDA processes were
ended by a program on the GPU, not necessarily its own (``MPS_FAULT_TEXT``), and the
device's MPS server is recovered in the background, new shares waiting for it.

The temperature has one rule, the alert policy's (``temp_high_c``, held ``hold_s``): the
alert it raises for a GPU is that fault's alert, and the GPU is drained with it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, cast

from wire.messages import FaultReport, to_control
from wire.spec import SandboxSpec
from wire.telemetry import AlertMessage
from wire.xids import describe, is_application
from workers.host.context import HostContext
from workers.host.memory_repairs import MemoryRepairWatch

log = logging.getLogger(__name__)
# Fault event kind -> the alert kind that tells of it.
ALERT_KIND = {
    "xid": "xid",
    "app_xid": "xid",
    "ecc_dbe": "ecc",
    "gpu_lost": "gpu_lost",
    # the board's memory repairs: an ECC matter, open until an admin undrains the GPU
    "remap_failed": "ecc",
    "remap_pending": "ecc",
    "retirement_pending": "ecc",
}
# What the owner of a share on an MPS device hears after an application XID there, after
# "XID <n>: ". Not the XID's description: that says "a kernel touched memory it does not
# own", which for every share but one is someone else's kernel.
MPS_FAULT_TEXT = (
    "its CUDA processes were ended by a fault of a program on this GPU, not necessarily its own "
    "(under MPS one fault ends every share's); the GPU itself is fine: start them again"
)


def is_application_fault(event: dict[str, Any]) -> bool:
    """The backend names an application XID ``app_xid``; an ``xid`` is classified again,
    so no path drains for one (wire.xids)."""
    kind, xid = event.get("kind"), int(event.get("xid") or 0)
    return kind == "app_xid" or (kind == "xid" and is_application(xid))


class GpuFaults:
    def __init__(self, context: HostContext) -> None:
        self.context = context
        self.host = context.host
        self.last_xid: dict[str, int] = {}  # GPU uuid -> the last XID it reported (for /metrics)
        self.lost: set[str] = set()  # GPUs that stopped answering: their alerts stay open
        self.memory = MemoryRepairWatch(context)

    def gpu_lost(self, uuid: str) -> None:
        """Sampling the GPU failed for good: stop sampling it (the backend queued the
        ``gpu_lost`` event, reported with this tick's faults); the rest of the host goes on."""
        if uuid in self.lost:
            return
        log.error("GPU %s on %s stopped answering: no longer sampled", uuid, self.host)
        self.lost.add(uuid)
        self.context.inventory.drop(uuid)

    def report(
        self, running: dict[str, SandboxSpec], alert_changes: list[AlertMessage], parent_of: dict[str, str]
    ) -> list[AlertMessage]:
        """This tick's faults: the device faults to the control worker (it drains), one
        alert per fault. ``alert_changes`` are this tick's rule alerts: a GPU's raised
        temperature alert is a fault (its own alert already)."""
        found = self.context.backend.fault_events() + self.memory.due_faults()
        events = [dataclasses.asdict(e) for e in found]
        for change in alert_changes:
            if change["kind"] == "temperature" and change["state"] == "raised" and change["sandbox"] is None:
                events.append(
                    {
                        "uuid": change["gpu"],
                        "kind": "overheat",
                        "detail": change["message"],
                        "t_ms": change["t"],
                    }
                )
        if not events:
            return []
        drains = [e for e in events if not is_application_fault(e)]
        if drains:
            log.error("GPU faults on %s: %s", self.host, drains)
            to_control.gpu_faults(self.host, cast(list[FaultReport], drains))  # cast: until events are typed
        changes: list[AlertMessage] = []
        for event in events:
            device = event["uuid"]
            gpu_uuid = parent_of.get(device, device)
            if event["kind"] == "gpu_lost":
                self.gpu_lost(gpu_uuid)  # reported by an event before a sample failed, too
            if event["kind"] in ("xid", "app_xid") and event.get("xid"):
                self.last_xid[gpu_uuid] = int(event["xid"])
            if event["kind"] not in ALERT_KIND:
                continue  # overheat: the temperature rule's alert is its alert
            changes += self._alert(event, device, gpu_uuid, running, parent_of)
        return changes

    def _alert(
        self,
        event: dict[str, Any],
        device: str,
        gpu_uuid: str,
        running: dict[str, SandboxSpec],
        parent_of: dict[str, str],
    ) -> list[AlertMessage]:
        kind, t_ms = ALERT_KIND[event["kind"]], int(event.get("t_ms") or 0)
        detail = str(event.get("detail") or "")
        if not is_application_fault(event):
            value = float(event.get("xid") or 0)
            text = detail or (describe(int(event["xid"])) if kind == "xid" else event["kind"])
            return self.context.alerts.note_fault(gpu_uuid, kind, value, text, t_ms)
        on_device = sandboxes_hit(device, {s.sandbox_id: s.device_uuids for s in running.values()}, parent_of)
        if not on_device:
            log.warning("application XID %s on %s with no sandbox on it: %s", event["xid"], device, detail)
            return []
        if mps_shares_on(device, running):
            self._recover_mps(device, event)
            text = f"XID {int(event['xid'])}: {MPS_FAULT_TEXT}"
        else:
            text = f"{detail or describe(int(event['xid']))}, from a program in the sandbox; the GPU is fine"
        return self.context.alerts.note_fault(gpu_uuid, kind, float(event["xid"]), text, t_ms, on_device)

    def _recover_mps(self, device: str, event: dict[str, Any]) -> None:
        why = str(event.get("detail") or describe(int(event["xid"])))
        if self.context.mps_recovery.begin(device, why):
            log.warning(
                "application XID on %s, which serves MPS shares: its server is being recovered", device
            )


def mps_shares_on(device_uuid: str, running: Mapping[str, SandboxSpec]) -> list[int]:
    """The sandboxes with an MPS share on ``device_uuid`` (a GPU, or a MIG instance with a
    daemon of its own): the clients of one MPS server, one fault domain."""
    return sorted(
        spec.sandbox_id
        for spec in running.values()
        if spec.mps is not None and spec.device_uuids[:1] == (device_uuid,)
    )


def sandboxes_hit(
    device_uuid: str, devices_of: Mapping[int, Iterable[str]], parent_of: Mapping[str, str]
) -> list[int]:
    """The sandboxes an event on ``device_uuid`` concerns: on a MIG device, those that hold
    it (NVML names the instance: only its tenant faulted); on a GPU, those on it or on any of
    its MIG devices (on a shared GPU, NVML does not say whose program it was).

    ``devices_of`` is sandbox id -> its device uuids, ``parent_of`` MIG uuid -> GPU uuid."""
    hit = []
    for sandbox_id, devices in devices_of.items():
        if device_uuid in parent_of:
            if device_uuid in devices:
                hit.append(sandbox_id)
        elif any(parent_of.get(d, d) == device_uuid for d in devices):
            hit.append(sandbox_id)
    return sorted(hit)
