"""An MPS server after a fault: its clients let go, new shares wait, and it accepts again.

What NVIDIA documents (MPS docs, error containment; quoted by NVIDIA staff on the NVIDIA
forums, "MPS Error Containment - Can't able to create new process"): a fatal GPU fault in
one MPS client is delivered to every client sharing that GPU's MPS server, and the server
then "will wait for client A, client B, and client C to exit and reject any new client
requests"; a new client gets ``cudaErrorMpsServerNotReady`` (807, "MPS Server Not Accepting
New Client Requests", MPS troubleshooting) until they exit, after which the server makes a
new context and serves again. So one tenant's out-of-bounds kernel (an application XID:
13, 31, 43, ...) ends every share's CUDA processes on the GPU (or MIG instance), and one
neighbour whose program caught the error and lives on (a Jupyter kernel is typical) keeps
every new CUDA process on the GPU failing. Review 3, new failure #6.

What the agent does (``MpsRecovery``), once ``workers.host.faults`` sees an application
XID on a device that MPS shares run on:

1. the server's clients are listed (``get_client_list <server pid>`` for each server of
   ``get_server_list``): all of them were hit, as the server takes no new one meanwhile;
2. they are given ``CLIENT_GRACE_S`` to exit by themselves (a program that died of the
   error has, by then);
3. those still attached are ended with ``terminate_client <server pid> <client pid>``, and
   given ``TERMINATE_WAIT_S`` to be gone from the list;
4. if some still are, or the daemon cannot be asked, the daemon is restarted
   (``MpsDaemons.restart``: ``quit`` and start, the daemon and its listed servers killed if
   ``quit`` does not end them within ``mps.STOP_TIMEOUT_S``; the server limits given
   again). Every client of the faulted server has lost its CUDA context already, so a
   restart costs no share anything more.

The bound: ``RECOVERY_BOUND_S`` = 30 s (3 s grace, 5 s after terminate_client, at most 10 s
for the daemon to quit, 2 s to die when killed and 10 s to start again: ``mps.STOP_TIMEOUT_S``,
``mps.KILL_TIMEOUT_S``, ``mps.START_TIMEOUT_S``; the control commands are quick). Each step
is logged. A launch of an MPS share on the device waits meanwhile (``wait_until_accepting``,
at most ``RECOVERY_BOUND_S``, its launch progress saying why) instead of starting a sandbox
whose CUDA would fail with 807; a recovery that failed (the daemon would not start again)
fails the launch with the reason, and the next launch on the device tries the recovery
again.

What this does not do: say whose program faulted (NVML names the device, not the process),
nor keep any share's process alive (NVIDIA's containment is per server). An application
XID that names a whole GPU whose MPS daemons serve its MIG instances names none of them:
no daemon is touched then (it could not tell a faulted server from a healthy one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.gpu.mps import MpsError
from workers.gpu.mps_daemons import MpsDaemons

log = logging.getLogger(__name__)

CLIENT_GRACE_S = 3.0
TERMINATE_WAIT_S = 5.0
RECOVERY_BOUND_S = 30.0
POLL_S = 0.25
WAITING = "waiting for the GPU's MPS server to recover from a fault"


@dataclass
class _Recovery:
    why: str  # the fault, for log lines
    started: float  # monotonic
    thread: threading.Thread | None = None


class MpsRecovery:
    """Recovers faulted MPS servers, one background thread per device, and holds launches of
    MPS shares on a device until its server accepts clients again. The bounds are arguments
    so that tests run the whole sequence in a second."""

    def __init__(
        self,
        daemons: MpsDaemons,
        grace_s: float = CLIENT_GRACE_S,
        terminate_s: float = TERMINATE_WAIT_S,
        bound_s: float = RECOVERY_BOUND_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.daemons = daemons
        self.grace_s = grace_s
        self.terminate_s = terminate_s
        self.bound_s = bound_s  # how long a launch waits for a recovery
        self.poll_s = poll_s
        self._clock = clock
        self._changed = threading.Condition(threading.RLock())
        self._under_way: dict[str, _Recovery] = {}  # device -> its recovery, while it runs
        self._failed: dict[str, str] = {}  # device -> why its last recovery failed

    # -- what the agent's parts call ------------------------------------------------------------

    def begin(self, device: str, why: str) -> bool:
        """Start recovering ``device``'s MPS server in the background (``why``: the fault); False
        when a recovery of it is under way already (the same fault seen twice, say)."""
        with self._changed:
            if device in self._under_way:
                return False
            self._failed.pop(device, None)
            recovery = self._under_way[device] = _Recovery(why, self._clock())
            recovery.thread = threading.Thread(
                target=self._run, args=(device,), name=f"mps-recovery-{device[:12]}", daemon=True
            )
            recovery.thread.start()
            return True

    def recovering(self, device: str) -> bool:
        with self._changed:
            return device in self._under_way

    def holds(self, device: str) -> bool:
        """A launch of a share on ``device`` must ask ``wait_until_accepting`` first: a recovery
        runs, or the last one failed."""
        with self._changed:
            return device in self._under_way or device in self._failed

    def wait_until_accepting(self, device: str, progress: Callable[[str], None]) -> str:
        """Hold a launch of an MPS share on ``device`` while its server recovers from a fault,
        at most ``bound_s``; "" when the server accepts clients (or never faulted), else why the
        share cannot start. A device whose last recovery failed is recovered again first."""
        with self._changed:
            if device in self._failed:
                self.begin(device, f"a new share, after a failed recovery ({self._failed[device]})")
            if device not in self._under_way:
                return ""
        progress(WAITING)
        log.info("a share on %s waits for its MPS server to recover", device)
        with self._changed:
            done = self._changed.wait_for(lambda: device not in self._under_way, self.bound_s)
            if not done:
                return (
                    f"the MPS server of {device} is still recovering from a fault of a program on the "
                    f"GPU after {self.bound_s:g} s: launch again shortly"
                )
            failed = self._failed.get(device)
        if failed:
            return (
                f"the MPS server of {device} did not recover from a fault of a program on the GPU: {failed}"
            )
        return ""

    def join(self, device: str, timeout_s: float) -> bool:
        """Wait for the device's recovery to end (tests, shutdown); True when none runs."""
        with self._changed:
            return self._changed.wait_for(lambda: device not in self._under_way, timeout_s)

    def failure(self, device: str) -> str:
        """Why the device's last recovery failed; "" when it did not."""
        with self._changed:
            return self._failed.get(device, "")

    # -- the recovery (on its own thread) --------------------------------------------------------

    def _run(self, device: str) -> None:
        recovery = self._under_way[device]
        failed = ""
        try:
            self.recover(device, recovery.why)
        except (MpsError, OSError) as exc:
            failed = str(exc)
            log.error("MPS server of %s did not recover from the fault (%s): %s", device, recovery.why, exc)
        except BaseException as exc:  # a bug: no launch may wait on a recovery that died
            failed = f"recovery failed: {exc!r}"
            log.exception("MPS recovery of %s failed", device)
        took = self._clock() - recovery.started
        with self._changed:
            del self._under_way[device]
            if failed:
                self._failed[device] = failed
            self._changed.notify_all()
        if not failed:
            log.info("MPS server of %s accepts clients again, %.1f s after the fault", device, took)

    def recover(self, device: str, why: str) -> None:
        """The steps of the module docstring, on this thread. MpsError when the daemon could
        not be restarted (the server may still refuse clients)."""
        control = self.daemons.control
        log.warning(
            "application fault on %s (%s): under MPS it ended the CUDA processes of every share on "
            "it; recovering its MPS server (bound %.0f s)",
            device, why, self.bound_s,
        )  # fmt: skip
        try:
            listed = control.clients(device)
        except MpsError as exc:
            log.warning("MPS daemon of %s cannot be asked for its clients (%s): restarting it", device, exc)
            self._restart(device, [])
            return
        servers = sorted(listed)  # killed with the daemon, should it come to that
        attached: dict[int, list[int]] | None = _attached(listed)
        log.info("MPS server of %s after the fault: clients %s", device, attached or "none")
        attached = self._wait_detached(device, attached, self.grace_s)
        if attached:
            for server, clients in sorted(attached.items()):
                for client in clients:
                    try:
                        control.terminate_client(device, server, client)
                        log.warning(
                            "MPS client %d of server %d on %s: terminate_client sent", client, server, device
                        )
                    except MpsError as exc:
                        log.warning("terminate_client %d %d on %s failed: %s", server, client, device, exc)
            attached = self._wait_detached(device, attached, self.terminate_s)
        if attached is None:
            log.warning("MPS daemon of %s stopped answering while it recovered: restarting it", device)
            self._restart(device, servers)
        elif attached:
            log.warning(
                "MPS clients %s of %s still attached after terminate_client: restarting its daemon",
                attached,
                device,
            )
            self._restart(device, servers)

    def _wait_detached(
        self, device: str, attached: dict[int, list[int]] | None, within_s: float
    ) -> dict[int, list[int]] | None:
        """The clients still attached after waiting up to ``within_s`` for them to go ({} when
        none is; None when the daemon stopped answering)."""
        deadline = self._clock() + within_s
        while attached:
            if self._clock() >= deadline:
                return attached
            time.sleep(self.poll_s)
            try:
                attached = _attached(self.daemons.control.clients(device))
            except MpsError:
                return None
        if attached is not None:
            log.info("MPS server of %s: no client attached any more", device)
        return attached

    def _restart(self, device: str, servers: list[int]) -> None:
        if self.daemons.restart(device, servers):
            log.warning("MPS daemon of %s restarted after the fault", device)
        else:
            log.info("MPS daemon of %s: no share holds it any more, stopped rather than restarted", device)


def _attached(clients: dict[int, list[int]]) -> dict[int, list[int]]:
    """The servers that have clients, with them."""
    return {server: pids for server, pids in clients.items() if pids}
