"""The MPS control daemons of a simulated host (``SimulatedMps``): ``workers.gpu.mps``'s
lifecycle, compute modes included, with no binary and no GPU."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from workers.gpu.mps import ComputeModes, MpsError, MpsManager, _claim_key

log = logging.getLogger(__name__)


class SimulatedMps(MpsManager):
    """The MPS control daemons of a simulated host: no binary and no GPU, the same lifecycle.

    ``start``, ``stop`` and ``running`` behave as the real manager's: idempotent, and a
    daemon outlives the agent that started it (a marker file in the device's directory
    stands in for the daemon's pid file), so an agent restart finds it up as it would a
    real one. Each start and stop is kept in ``history`` for whoever follows a GPU's
    daemon (the tests). The server limits a daemon was given are kept beside its marker
    (``limits``), and go with it. Other commands fail as they would on a host without the
    NVIDIA driver.
    """

    MARKER = "simulated-daemon"
    LIMITS = "simulated-limits"

    def __init__(
        self, root: Path | str, compute_modes: ComputeModes | None = None, enforced_elsewhere: bool = False
    ) -> None:
        """``compute_modes``: the simulated backend, whose devices are set to EXCLUSIVE_PROCESS
        while their daemon runs and refuse shares as a real one would when it cannot be set.
        None: compute modes are not modelled (tests of the lifecycle alone, or the record a
        Slurm node's agent keeps of shares whose MPS is Slurm's: ``enforced_elsewhere``)."""
        super().__init__(
            root, systemd=False, compute_modes=compute_modes, enforce=compute_modes is not None,
            enforced_elsewhere=enforced_elsewhere,
        )  # fmt: skip
        self.history: list[tuple[str, str]] = []  # ("start" | "stop", device uuid), in order

    def running(self, device_uuid: str) -> bool:
        return (self._device_dir(device_uuid) / self.MARKER).exists()

    def start(self, device_uuid: str) -> bool:
        with self._lock:
            if self.running(device_uuid):
                self._enforce(device_uuid)
                return False
            pipe = self.pipe_dir(device_uuid)
            pipe.mkdir(parents=True, exist_ok=True)
            _claim_key(self._device_dir(device_uuid), device_uuid)
            try:
                self._enforce(device_uuid)
            except MpsError:
                with contextlib.suppress(MpsError):
                    self._restore_mode(device_uuid)
                raise
            # The mount is real: the sandbox's uid must be able to traverse down to it (mkdir's
            # mode is cut by the umask).
            for directory in (pipe, *pipe.parents):
                if directory == self.root.parent:
                    break
                directory.chmod(0o755)
            (self._device_dir(device_uuid) / self.MARKER).write_text(f"{os.getpid()}\n")
            self.history.append(("start", device_uuid))
            log.info("simulated MPS control daemon for %s started", device_uuid)
            return True

    def stop(self, device_uuid: str) -> bool:
        with self._lock:
            if not self.running(device_uuid):
                return False
            (self._device_dir(device_uuid) / self.MARKER).unlink(missing_ok=True)
            (self._device_dir(device_uuid) / self.LIMITS).unlink(missing_ok=True)
            self._restore_mode(device_uuid)
            self.history.append(("stop", device_uuid))
            log.info("simulated MPS control daemon for %s stopped", device_uuid)
            return True

    def set_server_limits(self, device_uuid: str, thread_pct: int, memory_mib: int) -> None:
        if not self.running(device_uuid):
            raise MpsError(f"no MPS daemon runs for {device_uuid}")
        (self._device_dir(device_uuid) / self.LIMITS).write_text(f"{int(thread_pct)} {int(memory_mib)}\n")

    def limits(self, device_uuid: str) -> tuple[int, int] | None:
        """(thread %, pinned MiB) the device's daemon holds its clients to; None when unset."""
        try:
            pct, mib = (self._device_dir(device_uuid) / self.LIMITS).read_text().split()
        except FileNotFoundError:
            return None
        return int(pct), int(mib)

    def clients(self, device_uuid: str) -> dict[int, list[int]]:
        """A simulated daemon serves no CUDA process: no server, no client (a fault on a
        simulated GPU finds nothing to recover, as on a GPU whose clients all exited)."""
        if not self.running(device_uuid):
            raise MpsError(f"no MPS daemon runs for {device_uuid}")
        return {}
