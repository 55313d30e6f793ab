"""A driver that cannot run on this host at all, and how to say what to install.

Its own module, below the package: ``make_driver`` (``workers.drivers``) loads a driver
only when it is chosen, and the drivers raise these, so neither imports the other back.
"""

from __future__ import annotations

import os
import shutil


class DriverUnavailable(RuntimeError):
    """The driver cannot be used on this host at all: what is missing, and how to get it."""

    def __init__(self, driver: str, reason: str, remedy: str) -> None:
        super().__init__(f"{driver}: {reason}")
        self.driver = driver
        self.reason = reason
        self.remedy = remedy


def install_command(package: str) -> str:
    """The command that installs a distribution package here (with sudo unless root)."""
    sudo = "" if os.geteuid() == 0 else "sudo "
    for tool, command in (
        ("apt-get", f"apt-get install -y {package}"),
        ("dnf", f"dnf install -y {package}"),
        ("zypper", f"zypper install -y {package}"),
        ("pacman", f"pacman -S --noconfirm {package}"),
    ):
        if shutil.which(tool):
            return sudo + command
    return f"install the '{package}' package with your distribution's package manager"
