"""Sandbox drivers; ``make_driver`` picks one by the agent's configured kind."""

from __future__ import annotations

from pathlib import Path

from workers.drivers.base import SandboxDriver

DRIVER_KINDS = ("docker", "process", "libvirt", "auto")
# The isolation level each driver gives a sandbox: a host runs one driver, so it serves
# only requests for that level (a VM request must never get a container).
DRIVER_ISOLATION = {"docker": "container", "process": "process", "libvirt": "vm"}


def make_driver(kind: str, host: str, state_dir: Path) -> SandboxDriver:
    """``docker``, ``process``, ``libvirt``, or ``auto``: docker when an engine answers, else
    process (``auto`` never picks libvirt: VMs are an isolation level an admin chooses).

    Drivers are imported here, not at module level, so a host without the docker SDK
    (or libvirt) can still run the process driver.
    """
    if kind not in DRIVER_KINDS:
        raise ValueError(f"unknown sandbox driver {kind!r}; expected one of {DRIVER_KINDS}")
    if kind == "libvirt":
        from workers.drivers.libvirt import LibvirtDriver

        return LibvirtDriver(host=host)
    if kind in ("docker", "auto"):
        from workers.drivers.docker import DockerDriver, docker_available

        if kind == "docker" or docker_available():
            return DockerDriver(host=host)
    from workers.drivers.process import ProcessDriver

    return ProcessDriver(state_dir, host=host)
