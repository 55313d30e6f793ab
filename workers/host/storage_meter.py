"""The storage the sandboxes here write, measured and reported to the control plane.

Each read-write volume a sandbox mounts (a home, a project folder) is walked after the
sandbox stops, and every ``storage_interval_s`` while it runs, so that an owner filling a
home hears of it while working rather than at the end. A volume two sandboxes mount is
walked once a round. The portal warns at 90 % and 100 % of the limit and refuses new GPU
sandboxes past it (portal/sandboxes/storage_usage.py).
"""

from __future__ import annotations

import logging
import threading

from wire.messages import to_control
from wire.spec import SandboxSpec
from workers.agent_settings import AgentSettings
from workers.drivers.base import SandboxDriver
from workers.drivers.storage import measure
from workers.host.sandboxes import HostSandboxes

log = logging.getLogger(__name__)


class StorageMeter:
    def __init__(self, settings: AgentSettings, driver: SandboxDriver, sandboxes: HostSandboxes) -> None:
        self.settings = settings
        self.driver = driver
        self.sandboxes = sandboxes

    def report(self, spec: SandboxSpec, measured: dict[int, list[object]] | None = None) -> None:
        """Measure ``spec``'s read-write volumes (reusing this round's ``measured`` ones) and
        send what they hold: {volume id: [bytes, whether the walk finished]}."""
        root = self.driver.storage_dir
        if root is None:  # a driver that mounts nothing (simulated hosts)
            return
        measured = {} if measured is None else measured
        usage = {}
        for mount in spec.mounts:
            if mount.read_only or not mount.volume:
                continue
            if mount.volume not in measured:
                # By the root and the relative path: the tenant writes in the volume while it
                # is walked, and nothing there is followed (storage.measure).
                found = measure(root, mount.source, self.settings.storage_measure_s)
                if found is None:  # not on this host
                    continue
                measured[mount.volume] = list(found)
            usage[str(mount.volume)] = measured[mount.volume]
        if usage:
            to_control.storage_usage(spec.sandbox_id, usage)

    def round(self) -> None:
        """Every running sandbox's volumes, each walked once."""
        measured: dict[int, list[object]] = {}
        for spec in self.sandboxes.specs().values():
            try:
                self.report(spec, measured)
            except Exception:  # one volume's trouble must not stop the others' reports
                log.exception("measuring the storage of sandbox %s failed", spec.sandbox_id)

    def run_forever(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.settings.storage_interval_s):
            self.round()
