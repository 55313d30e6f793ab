"""A process sandbox's limits: cgroup v2 (memory.max, memory.swap.max, cpu.max, pids.max) or
cgroup v1 (memory, memsw, CFS quota, pids) under ``<mount>/gpushare/<allocation>``, whichever
the host mounts with those controllers and lets us write; otherwise ``prlimit`` (RLIMIT_AS,
RLIMIT_NPROC): weaker, since RLIMIT_AS caps address space rather than memory, RLIMIT_NPROC
counts every process of the host uid (so it is set only when the sandbox has a uid of its
own), and nothing caps CPU.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from wire.spec import SandboxSpec
from workers.drivers.procfs import signal_all

log = logging.getLogger(__name__)

_CGROUP_PARENT = "gpushare"
_CPU_PERIOD_US = 100_000
_POLL_S = 0.05
# The wrapper shell, outer bwrap and bwrap's init live in the sandbox's pids cgroup too.
WRAPPER_PIDS = 3


@dataclass(frozen=True)
class Limits:
    mode: str  # "cgroup-v2" | "cgroup-v1" | "rlimit"
    cgroups: tuple[str, ...]  # directories made for this sandbox
    procs_files: tuple[str, ...]  # cgroup.procs files the wrapper joins
    prlimit: tuple[str, ...]  # prlimit prefix for the rlimit fallback


def cgroup_mounts() -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount with memory+cpu+pids, or None; v1 controller -> mount point)."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, options, *_ = line.split()
        if fstype == "cgroup2":
            controllers = Path(target, "cgroup.controllers")
            with contextlib.suppress(OSError):
                if {"memory", "cpu", "pids"} <= set(controllers.read_text().split()):
                    v2 = target
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("memory", "cpu", "pids"):
                    v1[option] = target
    return v2, v1


def make_cgroups(spec: SandboxSpec) -> Limits:
    """Create and fill the sandbox's cgroups; OSError when the host will not let us."""
    memory = spec.memory_limit_mib * 1024 * 1024
    quota = max(1000, round(spec.cpu_limit * _CPU_PERIOD_US))
    pids = spec.pids_limit + WRAPPER_PIDS
    v2, v1 = cgroup_mounts()
    made: list[Path] = []
    try:
        if v2 is not None:
            parent = Path(v2, _CGROUP_PARENT)
            parent.mkdir(exist_ok=True)
            # Controllers must be enabled on every level above the leaf.
            for level in (Path(v2), parent):
                (level / "cgroup.subtree_control").write_text("+memory +cpu +pids")
            leaf = parent / spec.allocation_key
            leaf.mkdir(exist_ok=True)
            made.append(leaf)
            (leaf / "memory.max").write_text(str(memory))
            if (leaf / "memory.swap.max").exists():
                (leaf / "memory.swap.max").write_text("0")
            (leaf / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
            (leaf / "pids.max").write_text(str(pids))
            return Limits("cgroup-v2", (str(leaf),), (str(leaf / "cgroup.procs"),), ())
        if {"memory", "cpu", "pids"} <= v1.keys():
            leaves = {c: Path(v1[c], _CGROUP_PARENT, spec.allocation_key) for c in v1}
            for leaf in dict.fromkeys(leaves.values()):  # co-mounted controllers share one
                leaf.mkdir(parents=True, exist_ok=True)
                made.append(leaf)
            # The memory limit goes first: memsw may never be below it.
            (leaves["memory"] / "memory.limit_in_bytes").write_text(str(memory))
            if (leaves["memory"] / "memory.memsw.limit_in_bytes").exists():
                (leaves["memory"] / "memory.memsw.limit_in_bytes").write_text(str(memory))
            (leaves["cpu"] / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
            (leaves["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
            (leaves["pids"] / "pids.max").write_text(str(pids))
            dirs = tuple(str(d) for d in made)
            return Limits("cgroup-v1", dirs, tuple(f"{d}/cgroup.procs" for d in dirs), ())
        raise OSError(errno.ENOTSUP, "no cgroup hierarchy with memory, cpu and pids")
    except OSError:
        remove_cgroups(tuple(str(d) for d in made))
        raise


def rlimits(spec: SandboxSpec, private_uid: bool) -> Limits:
    prlimit = ["prlimit", f"--as={spec.memory_limit_mib * 1024 * 1024}"]
    if private_uid:
        prlimit.append(f"--nproc={spec.pids_limit + WRAPPER_PIDS}")
    else:
        # RLIMIT_NPROC counts every process of the host uid: on a shared uid it would
        # count other sandboxes (and containers) too and fail launches at random.
        log.warning("sandbox %s has no pids limit: its host uid is shared", spec.allocation_key)
    return Limits("rlimit", (), (), tuple(prlimit))


def oom_kills(dirs: tuple[str, ...]) -> int:
    """Processes the kernel killed at the memory limit: ``oom_kill`` in cgroup v2's
    memory.events or v1's memory.oom_control (kernels from 4.13 count it there)."""
    kills = 0
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError):
                for line in Path(d, name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        kills += int(value)
    return kills


def remove_cgroups(dirs: tuple[str, ...]) -> None:
    for d in dirs:
        procs = Path(d, "cgroup.procs")
        for _ in range(40):
            if not procs.exists():
                break
            with contextlib.suppress(OSError, ValueError):
                signal_all([int(p) for p in procs.read_text().split()], signal.SIGKILL)
            try:
                Path(d).rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(_POLL_S)  # EBUSY until the killed processes are gone
        else:
            log.warning("could not remove cgroup %s", d)
