"""What an XID means for the GPU: a tenant's own fault, or a sick device.

The driver reports an XID for anything from an out-of-bounds kernel to a board that fell
off the bus. Draining a GPU for the first kind takes a healthy board (on MIG: every tenant
on it) out of scheduling for one tenant's bug, so XIDs are classified here, once, for both
the agent (which names the event kind) and the control side (which drains only on a device
fault, also when an older agent sends every XID as ``xid``).

Application XIDs are the ones NVIDIA's own Kubernetes device plugin ignores as "application
errors: the GPU should still be healthy" (k8s-device-plugin ``internal/rm/health.go``,
``ignoredXids``). Device XIDs and their descriptions follow NVIDIA's XID catalogue
(docs.nvidia.com/deploy/xid-errors). An XID in neither list counts as a device fault, as
the device plugin treats it: an unknown fault drains (an admin undrains), it does not pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

XidClass = Literal["application", "device"]
APPLICATION: XidClass = "application"
DEVICE: XidClass = "device"


@dataclass(frozen=True)
class XidInfo:
    xid: int
    cls: XidClass
    description: str
    reset: bool = False  # the GPU needs a reset before it is trusted again


# The tenant's own fault: raise it to the sandbox's owner, keep the GPU in service.
_APPLICATION = {
    13: "graphics engine exception (e.g. an illegal instruction or address in a kernel)",
    31: "GPU memory page fault (a kernel touched memory it does not own)",
    43: "GPU stopped processing (a kernel was killed or hit an error)",
    45: "preemptive cleanup after a previous error (a process ended or was killed)",
    68: "video processor (NVDEC) exception",
    109: "context switch timeout",
}

# The board is at fault: drain it. (description, reset needed)
_DEVICE = {
    8: ("GPU stopped processing (channel idle timeout)", False),
    32: ("invalid or corrupted push buffer stream (PCIe or driver fault)", False),
    38: ("driver firmware error", True),
    48: ("double-bit ECC error", True),
    61: ("internal micro-controller breakpoint/warning", True),
    62: ("internal micro-controller halt", True),
    63: ("ECC page retirement or row remapping recorded (reset to apply)", True),
    64: ("ECC page retirement or row remapping failure", True),
    74: ("NVLink error", True),
    79: ("GPU has fallen off the bus", True),
    92: ("high single-bit ECC error rate", False),
    93: ("non-fatal violation of the provisioned InfoROM wear limit", False),
    # Contained: only the process (on MIG: the instance) that touched the row was hit; the
    # row is remapped at the next reset, so the board drains and its tenants finish.
    94: ("contained ECC error (the affected process or MIG instance was stopped)", True),
    95: ("uncontained ECC error (every process on the GPU is affected)", True),
    119: ("GSP RPC timeout", True),
    120: ("GSP error", True),
    121: ("C2C link error", True),
    140: ("unrecovered ECC error", True),
    154: ("GPU recovery action changed (the driver asks for a reset or reboot)", True),
}


def classify(xid: int) -> XidInfo:
    """The class and a short description of ``xid``; unknown XIDs are device faults."""
    if xid in _APPLICATION:
        return XidInfo(xid, APPLICATION, _APPLICATION[xid])
    description, reset = _DEVICE.get(xid, ("XID not in the catalogue (treated as a device fault)", False))
    return XidInfo(xid, DEVICE, description, reset)


def is_application(xid: int) -> bool:
    return classify(xid).cls == APPLICATION


def describe(xid: int) -> str:
    """E.g. "XID 31: GPU memory page fault (...)", for event details and log lines."""
    info = classify(xid)
    return f"XID {xid}: {info.description}" + ("; the GPU needs a reset" if info.reset else "")
