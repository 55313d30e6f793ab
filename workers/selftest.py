"""An agent's start-up self-test: launch one tiny sandbox with its driver and stop it.

A host whose driver cannot launch must not take sandboxes: every request placed on it
would end ``failed`` with the same message (bubblewrap missing, the Docker engine down, no
libvirt). So an agent tests its driver before it consumes a single task and refuses to
start when the test fails, saying why and what to do; ``make run`` runs the same test
before it starts the demo agents. ``python -m workers.selftest`` runs it from a shell with
the agent's environment (SANDBOX_DRIVER, GPUSHARE_HOST, GPUSHARE_VAR_DIR).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from wire import config
from wire.spec import DRIVER_ISOLATION, SandboxSpec
from workers.drivers import DriverUnavailable, install_command, make_driver
from workers.drivers.base import DriverError, SandboxDriver

log = logging.getLogger(__name__)

SANDBOX_IMAGE = "gpushare/sandbox-base:1"
_TIMEOUT_S = 120.0  # a VM boots under TCG in CI; a container or process takes a second
_POLL_S = 0.1


@dataclass(frozen=True)
class SelfTest:
    ok: bool
    driver: str
    detail: str  # what happened, in one line
    remedy: str = ""  # what the operator can do about it ("" when ok)

    def describe(self) -> str:
        if self.ok:
            return f"sandbox driver {self.driver}: {self.detail}"
        return f"sandbox driver {self.driver} cannot launch sandboxes: {self.detail}" + (
            f"\n    to fix: {self.remedy}" if self.remedy else ""
        )


def _remedy(driver: str, detail: str) -> str:
    lowered = detail.lower()
    if driver == "process":
        if "bwrap" in lowered and ("no such file" in lowered or "not installed" in lowered):
            return install_command("bubblewrap")
        if "namespace" in lowered or "operation not permitted" in lowered:
            return (
                "bubblewrap needs user namespaces: run the agent as root, or allow unprivileged "
                "ones (sysctl -w kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000)"
            )
        return "see the agent's log; SANDBOX_DRIVER=docker uses a container engine instead"
    if driver == "docker":
        if "not found" in lowered and "image" in lowered:
            return f"build the sandbox image: make image (it builds {SANDBOX_IMAGE} locally)"
        return "start the Docker engine (systemctl start docker), or set SANDBOX_DRIVER=process"
    if driver == "libvirt":
        return "start libvirtd (systemctl start libvirtd) and check LIBVIRT_URI, VM_KERNEL and VM_INITRD"
    return ""


def _spec(driver: SandboxDriver, host: str) -> SandboxSpec:
    return SandboxSpec(
        allocation_key=f"selftest-{uuid.uuid4().hex[:12]}",
        sandbox_id=0,
        host=host,
        project="gpushare-selftest",
        owner="gpushare",
        image=SANDBOX_IMAGE,
        command=("true",),
        device_uuids=(),
        real_gpu=False,
        memory_limit_mib=128,
        pids_limit=32,
        isolation=DRIVER_ISOLATION.get(driver.name, ""),
    )


def try_driver(driver: SandboxDriver, host: str, timeout_s: float = _TIMEOUT_S) -> SelfTest:
    """Launch ``true`` with ``driver``, wait for it to run or end with 0, then stop it."""
    spec = _spec(driver, host)
    started = time.monotonic()
    try:
        handle = driver.launch(spec)
    except DriverError as exc:
        return SelfTest(False, driver.name, str(exc), _remedy(driver.name, str(exc)))
    try:
        deadline = started + timeout_s
        while True:
            status = driver.status(handle)
            if status.state == "running" or (status.state == "exited" and status.exit_code == 0):
                took = time.monotonic() - started
                return SelfTest(True, driver.name, f"a test sandbox launched and stopped in {took:.1f} s")
            if status.state in ("exited", "missing"):
                detail = f"the test sandbox ended {status.state}" + (
                    f" with exit code {status.exit_code}" if status.exit_code is not None else ""
                )
                if status.reason:
                    detail += f" ({status.reason})"
                return SelfTest(False, driver.name, detail, _remedy(driver.name, detail))
            if time.monotonic() > deadline:
                detail = f"the test sandbox did not start within {timeout_s:.0f} s"
                return SelfTest(False, driver.name, detail, _remedy(driver.name, detail))
            time.sleep(_POLL_S)
    except DriverError as exc:
        return SelfTest(False, driver.name, str(exc), _remedy(driver.name, str(exc)))
    finally:
        try:
            driver.stop(handle, grace_s=2.0)
        except DriverError:
            log.warning("self-test sandbox %s could not be stopped", spec.allocation_key, exc_info=True)


def run(kind: str, host: str, state_dir: Path) -> SelfTest:
    """Make the driver the agent would make and test it."""
    try:
        driver = make_driver(kind, host, state_dir)
    except DriverUnavailable as exc:
        return SelfTest(False, exc.driver, exc.reason, exc.remedy)
    return try_driver(driver, host)


def main() -> int:
    host = os.environ.get("GPUSHARE_HOST") or "selftest"
    result = run(config.sandbox_driver_kind(), host, config.var_dir() / "agents" / host / "sandboxes")
    print(result.describe())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
