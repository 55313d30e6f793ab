"""Sandbox drivers; ``make_driver`` picks one by the agent's configured kind."""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.drivers.base import SandboxDriver
from workers.drivers.unavailable import DriverUnavailable, install_command

__all__ = ["DRIVER_KINDS", "DriverUnavailable", "install_command", "make_driver"]

DRIVER_KINDS = ("docker", "process", "libvirt", "simulated", "auto")
# The isolation level each gives a sandbox is wire.spec.DRIVER_ISOLATION (the portal places by it).


USERNS_REMEDY = (
    "let unprivileged users create user namespaces for bwrap: on Ubuntu 23.10 and later give "
    "/usr/bin/bwrap an AppArmor profile with 'userns,' (or sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0); elsewhere sysctl -w "
    "kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000"
)


def make_driver(kind: str, host: str, state_dir: Path) -> SandboxDriver:
    """``docker``, ``process``, ``libvirt``, ``simulated``, or ``auto``: docker when an engine
    answers, else process (``auto`` never picks libvirt: VMs are an isolation level an admin
    chooses; nor the state-only ``simulated``, which runs nothing).

    Drivers are imported here, not at module level, so a host without the docker SDK
    (or libvirt-python, an optional extra) can still run the process driver. A driver whose
    software is missing raises DriverUnavailable naming what to install.
    """
    if kind not in DRIVER_KINDS:
        raise ValueError(f"unknown sandbox driver {kind!r}; expected one of {DRIVER_KINDS}")
    if kind == "simulated":
        from workers.drivers.simulated import SimulatedDriver

        return SimulatedDriver(state_dir, host=host)
    if kind == "libvirt":
        from workers.drivers.libvirt import LibvirtDriver

        return LibvirtDriver(host=host)
    if kind in ("docker", "auto"):
        from workers.drivers.docker import DockerDriver, docker_available

        if kind == "docker" or docker_available():
            return DockerDriver(host=host)
    if shutil.which("bwrap") is None:
        missing = "bubblewrap (bwrap) is not installed"
        raise DriverUnavailable("process", missing, install_command("bubblewrap"))
    from workers.drivers.process import ProcessDriver, bwrap_problem

    # Probed as launches run it (through setpriv as an unprivileged uid under a root agent),
    # so a host that allows user namespaces to root only fails here, not at every launch.
    problem = bwrap_problem()
    if problem is not None:
        raise DriverUnavailable("process", problem, USERNS_REMEDY)
    return ProcessDriver(state_dir, host=host)
