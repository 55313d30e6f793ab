"""What this host runs: the one picture the agent's parts share, under one lock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from wire.spec import SandboxHandle, SandboxSpec


@dataclass
class HostSandboxes:
    """Sandboxes by allocation id. ``lock`` guards every field: the Celery task threads
    (launch, stop) and the sampler's thread read and change them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: dict[str, SandboxSpec] = field(default_factory=dict)
    handles: dict[str, SandboxHandle] = field(default_factory=dict)
    # Stopped already: a launch that arrives late must not revive them.
    stopped: set[str] = field(default_factory=set)
    # Launches under way (allocation id -> sandbox id): a driver lists a sandbox only once
    # it is set up, and a report taken meanwhile must still say it is coming.
    launching: dict[str, int] = field(default_factory=dict)

    def specs(self) -> dict[str, SandboxSpec]:
        with self.lock:
            return dict(self.running)

    def mig_instances_in_use(self) -> dict[str, str]:
        """MIG uuid -> sandbox id, for every MIG instance a sandbox here sees."""
        specs = self.specs().values()
        return {d: str(s.sandbox_id) for s in specs for d in s.device_uuids if d.startswith("MIG-")}
