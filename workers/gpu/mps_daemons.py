"""Each GPU's MPS control daemon follows the GPU's mode, on the agent's side.

A GPU that follows demand serves MPS shares for a while, then goes back to idle and may
next be dedicated or time-sliced; neither may run under an MPS daemon (a daemon left up
would take in any CUDA process that finds its pipe, and the next sandbox would not have
the GPU it was promised). So a GPU's daemon runs exactly while MPS sandboxes of this agent
hold the GPU, or while the GPU is pinned to MPS (then it may stay up between shares).

Every sandbox the agent launches is registered here by device before its driver launches
it (``claim``), and unregistered once its driver has stopped it (``release``). Daemons
start and stop under the same lock, so:

- a share launched while the last one on its GPU stops either keeps the daemon up (it was
  registered first) or starts it again (the stop came first): it never runs without one;
- the daemon stops only after its last client's processes are gone (quitting it under a
  live client would end that client's MPS server with it);
- a dedicated or time-slice sandbox never starts while a daemon is up on its GPU: one left
  up without shares (the GPU was pinned to MPS, or the agent restarted) is stopped first;
  one that still has shares (their stop is on its way, on another task thread) is waited
  for up to ``handover_s``, and the launch is refused with the reason if they stay. The
  same holds the other way round, for a share arriving while a whole GPU or a replica of
  it still runs.

Enforcement. ``control.start`` leaves a share's device in EXCLUSIVE_PROCESS, read back, on
every claim (not only the one that starts the daemon), or raises ``MpsNotEnforced``: the share
is then refused with that message (the launch fails, ``sandbox_launch_failed``), never run
where its tenant could leave MPS. Stopping a daemon (last share gone, a dedicated sandbox
arriving, a MIG instance retired) puts DEFAULT back.

After a restart the agent knows none of this: its driver still lists what runs, and the
control plane has it adopted (a launch again, which claims it). ``sweep`` stops daemons
that no share holds once everything listed is tracked again.

Limits. All shares on a GPU run as that GPU's one MPS uid (``uids.mps_uid``: one server
serves one uid, a client of another uid waits for it to drain), so they meet in one MPS
server, and a server's limits cannot differ between its clients. The rule: the server holds
every client to the largest share now on the GPU (thread % and pinned memory, each the
largest), set before the share's sandbox starts (so before its first CUDA call). Each
share's own, smaller, limit is in its environment (``SandboxSpec.gpu_env``), which MPS
applies below the server's, and which a tenant can unset. So what is enforced whatever the
tenant does is the largest grant on the GPU; a share's own grant, below that, holds only
while its environment is left alone (and a client keeps the server limits it connected
with until it exits). A GPU whose shares all have one size, the common case, is enforced
exactly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

from wire.spec import SandboxSpec
from workers.gpu.mps import MpsError, MpsManager, MpsNotEnforced

log = logging.getLogger(__name__)

# Beyond a sandbox's stop grace (5 s): the stop that frees the GPU is that long at most. Below
# the control plane's launch resend (15 s), so a resent launch finds this one decided.
HANDOVER_S = 10.0


class Claim(NamedTuple):
    refusal: str  # why the sandbox cannot run here now; "" when it can
    new: bool  # this call registered it (and its launch's failure releases it)


class MpsDaemons:
    def __init__(self, control: MpsManager, handover_s: float = HANDOVER_S) -> None:
        self.control = control  # MpsManager on a GPU host, SimulatedMps on a simulated one
        self.handover_s = handover_s
        self._changed = threading.Condition()
        self._shares: dict[str, set[str]] = {}  # device -> allocation ids of MPS sandboxes on it
        self._others: dict[str, set[str]] = {}  # device -> allocation ids of other sandboxes on it
        self._devices: dict[str, tuple[str, ...]] = {}  # allocation id -> the devices it holds
        self._pinned: set[str] = set()  # GPUs pinned to MPS, as the last spec or message said
        self._grants: dict[str, tuple[int, int]] = {}  # share's allocation id -> (thread %, MiB)
        # device -> the server limits its daemon was last given (by this agent); dropped when the
        # daemon stops, unknown for a daemon found running (so given again).
        self._applied: dict[str, tuple[int, int]] = {}

    def claim(self, spec: SandboxSpec) -> Claim:
        """Register ``spec``'s sandbox on its devices and put their daemons in the state it
        needs: up for an MPS share, down for anything else. Says why it cannot run here now
        ("" when it can), and whether this call registered it: a repeated launch of a
        registered sandbox (a resend while the first waits here, say) claims nothing, and
        must not release what the first copy's sandbox holds when its own launch fails."""
        key, devices = spec.allocation_key, spec.device_uuids
        share = spec.mps is not None and bool(devices)
        with self._changed:
            if key in self._devices:
                return Claim("", new=False)
            if share:
                if spec.mps_pinned:
                    self._pinned.add(devices[0])
                else:
                    self._pinned.discard(devices[0])
            blockers = self._others if share else self._shares
            targets = devices[:1] if share else devices
            if not self._changed.wait_for(lambda: not self._held(blockers, targets), self.handover_s):
                held = ", ".join(d for d in targets if blockers.get(d))
                if share:
                    return Claim(
                        f"GPU {held} still runs a dedicated or time-slice sandbox: no MPS share can join",
                        False,
                    )
                return Claim(
                    f"GPU {held} still serves MPS shares: no dedicated or time-slice sandbox joins them",
                    False,
                )
            if key in self._devices:  # registered by a copy of this launch while we waited
                return Claim("", new=False)
            try:
                if share:
                    if self.control.start(devices[0]):
                        self._applied.pop(devices[0], None)  # a new daemon has no limits yet
                    grant = (spec.mps.thread_pct, spec.mps.memory_mib) if spec.mps else None
                    self._limit(devices[0], extra=grant)
                else:
                    for device in devices:
                        self._pinned.discard(device)  # it takes another mode: no longer pinned to MPS
                        self._applied.pop(device, None)
                        # Also when none runs: one that died may have left the compute mode.
                        if self.control.stop(device):
                            log.info("MPS daemon of %s up without shares: stopped for %s", device, key)
            except (MpsError, OSError) as exc:
                if share and devices[0] not in self._shares and devices[0] not in self._pinned:
                    self._stop(devices[0])  # started for this share alone: not left up idle
                if isinstance(exc, MpsNotEnforced):  # it names the device and says why
                    return Claim(str(exc), new=False)
                return Claim(f"MPS daemon for {', '.join(targets)}: {exc}", new=False)
            for device in targets:
                (self._shares if share else self._others).setdefault(device, set()).add(key)
            self._devices[key] = targets
            if share and spec.mps is not None:
                self._grants[key] = (spec.mps.thread_pct, spec.mps.memory_mib)
            return Claim("", new=True)

    def release(self, allocation_key: str) -> None:
        """Unregister a sandbox its driver stopped (or never made). The last share on a GPU
        not pinned to MPS stops the GPU's daemon."""
        with self._changed:
            self._grants.pop(allocation_key, None)
            for device in self._devices.pop(allocation_key, ()):
                self._discard(self._others, device, allocation_key)
                if allocation_key in self._shares.get(device, ()):
                    self._discard(self._shares, device, allocation_key)
                    if device not in self._shares and device not in self._pinned:
                        self._stop(device)
                    elif device in self._shares:
                        self._lower(device)  # the largest share left may be smaller
            self._changed.notify_all()

    def set_pinned(self, device: str, pinned: bool) -> None:
        """The GPU's admin pinned it to MPS, or no longer: unpinned and without shares, its
        daemon stops now rather than at the next launch."""
        with self._changed:
            if pinned:
                self._pinned.add(device)
                return
            self._pinned.discard(device)
            if device not in self._shares and self._up(device):
                self._stop(device)

    def sweep(self, devices: Iterable[str]) -> None:
        """Stop the daemons of ``devices`` that no share holds on a GPU not pinned to MPS.
        Call it only when everything the driver lists is registered (tracked): until a
        restarted agent has adopted its sandboxes, an MPS share may hold a daemon unseen."""
        with self._changed:
            for device in devices:
                if device not in self._shares and device not in self._pinned and self._up(device):
                    log.info("MPS daemon of %s runs without shares: stopped", device)
                    self._stop(device)

    def retire(self, device: str) -> None:
        """Make a MIG instance about to be destroyed free of MPS: its daemon quits (and with
        it the MPS server, which outlives its last client and holds the instance, so NVML's
        destroy would fail with IN_USE, review §2.2), and a pin to MPS goes with the instance.
        MpsError when a share still holds it (the plan's stops should have released it) or
        the daemon does not quit."""
        with self._changed:
            if self._shares.get(device):
                raise MpsError(f"MPS shares still run on {device}: {', '.join(sorted(self._shares[device]))}")
            self._pinned.discard(device)
            self._applied.pop(device, None)
            if self.control.running(device) and self.control.stop(device):
                log.info("MPS daemon of %s stopped: the instance is to be destroyed", device)

    def restart(self, device: str, servers: list[int] | None = None) -> bool:
        """Start the device's daemon afresh (``MpsManager.restart``: a faulted MPS server that
        would not recover, workers.gpu.mps_recovery), under the lock so that no share's claim
        or release meets it halfway, and give the new daemon the server limits of the shares
        on the device. False when no share holds the device and it is not pinned: then its
        daemon (if any) is only stopped, as the last share's release would have. MpsError
        when it does not stop or start."""
        with self._changed:
            self._applied.pop(device, None)  # a new daemon has no limits yet
            if device not in self._shares and device not in self._pinned:
                self._stop(device)
                return False
            self.control.restart(device, servers)
            self._limit(device)
            return True

    # -- internals (the lock held) ------------------------------------------------------------

    def _up(self, device: str) -> bool:
        """Whether the device's daemon runs, for the housekeeping that stops idle ones: when
        that cannot be told (systemd does not answer), it is logged and left for next time."""
        try:
            return self.control.running(device)
        except (MpsError, OSError) as exc:
            log.warning("cannot tell whether the MPS daemon of %s runs: %s", device, exc)
            return False

    @staticmethod
    def _held(by: dict[str, set[str]], devices: Iterable[str]) -> bool:
        return any(by.get(device) for device in devices)

    @staticmethod
    def _discard(by: dict[str, set[str]], device: str, key: str) -> None:
        held = by.get(device)
        if held is not None:
            held.discard(key)
            if not held:
                del by[device]

    def _largest(self, device: str, extra: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """The largest thread % and the largest pinned memory among the shares on ``device``
        (and ``extra``, a share about to join): the server limits of the rule above."""
        grants = [self._grants[key] for key in self._shares.get(device, ()) if key in self._grants]
        if extra is not None:
            grants.append(extra)
        if not grants:
            return None
        return max(pct for pct, _ in grants), max(mib for _, mib in grants)

    def _limit(self, device: str, extra: tuple[int, int] | None = None) -> None:
        """Give the device's server the rule's limits unless it has them. MpsError if the
        daemon does not take them: the share is refused rather than run with limits its
        tenant could lift."""
        limits = self._largest(device, extra)
        if limits is None or self._applied.get(device) == limits:
            return
        self.control.set_server_limits(device, *limits)
        self._applied[device] = limits
        log.info("MPS server limits of %s: %d %% of SMs, %d MiB pinned per client", device, *limits)

    def _lower(self, device: str) -> None:
        """After a share left: the server limits follow the largest share still there. A
        failure is logged: the limits stay as high as a share that ran, none higher."""
        try:
            self._limit(device)
        except (MpsError, OSError) as exc:
            log.warning("MPS server limits of %s not lowered: %s", device, exc)

    def _stop(self, device: str) -> None:
        """Stop a daemon; a failure is logged (the next launch or sweep tries again)."""
        started = time.monotonic()
        self._applied.pop(device, None)  # whatever happens, give the limits again next time
        try:
            stopped = self.control.stop(device)
        except (MpsError, OSError) as exc:
            log.warning("MPS daemon of %s did not stop: %s", device, exc)
            return
        if stopped:
            took = time.monotonic() - started
            log.info("MPS daemon of %s stopped in %.2f s: no share holds it", device, took)
