"""Request-to-running through the whole control loop, per sandbox driver (``make bench``).

Real processes (control worker, host agent, beat) against the test database and Redis:
a request is written the way the portal writes it, the control worker's cycle places it,
the agent launches it, and its launch report marks it running. The time is between the
``requested`` and ``running`` events, both written by the platform. Sandboxes are asked
for one after another (each stopped before the next), so the figure is the latency of an
idle platform, not of a queue. Results go to BENCHMARKS.md; nothing here asserts a time.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from portal.sandboxes import actions
from portal.sandboxes.models import Sandbox
from scheduler.research.bench_markdown import write_section
from tests.e2e.platform import running_platform, wait_for
from tests.portal.helpers import request
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.bench, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
RUNS = 15
VM_RUNS = 5  # VMs boot under TCG here: seconds each
BEGIN, END = "<!-- bench:launch:begin -->", "<!-- bench:launch:end -->"
RESULTS: dict[str, list[float]] = {}
TARGETS = {"container": "≤ 1.5 s", "process": "≤ 0.3 s", "vm": "-"}


def request_to_running(people: Any, catalog: Any, isolation: str) -> float:
    tier = catalog["dedicated"]
    if isolation not in tier.isolation_levels:
        tier.isolation_levels = [*tier.isolation_levels, isolation]
        tier.save(update_fields=["isolation_levels"])
    sandbox = request(people["owner"], people["project"], tier, catalog["image"], isolation=isolation)
    try:
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "running", 180, "the sandbox to run")
    except AssertionError as exc:
        history = list(Sandbox.objects.get(pk=sandbox.pk).events.values_list("to_state", "message"))
        raise AssertionError(f"{exc}: {history}") from exc
    events = {e.to_state: e.at for e in Sandbox.objects.get(pk=sandbox.pk).events.all()}
    actions.do_request_stop(sandbox.pk, people["owner"])
    wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "stopped", 60, "the sandbox to stop")
    return (events["running"] - events["requested"]).total_seconds()


def measure(people: Any, catalog: Any, tmp_path: Path, isolation: str, driver: str, runs: int = RUNS) -> None:
    with running_platform(tmp_path, driver=driver):
        request_to_running(people, catalog, isolation)  # warm-up: first image use, imports
        RESULTS[isolation] = [request_to_running(people, catalog, isolation) for _ in range(runs)]
    values = RESULTS[isolation]
    print(f"{isolation}: median {statistics.median(values):.3f} s, max {max(values):.3f} s over {runs}")


def test_container(people: Any, catalog: Any, tmp_path: Path) -> None:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    measure(people, catalog, tmp_path, "container", "docker")


def test_process(people: Any, catalog: Any, tmp_path: Path) -> None:
    from workers.drivers.process import bwrap_available

    require_engine(bwrap_available(), "bubblewrap")
    measure(people, catalog, tmp_path, "process", "process")


@pytest.mark.timeout(900)  # warm-up and VM_RUNS launches, each followed by a stop
def test_vm(people: Any, catalog: Any, tmp_path: Path) -> None:
    from workers.drivers.libvirt import GuestImage, libvirt_available

    require_engine(libvirt_available(), "libvirtd and QEMU")
    images = GuestImage.from_env()
    require_engine(images.kernel.exists(), f"the guest kernel {images.kernel} (scripts/build-vm-image.sh)")
    measure(people, catalog, tmp_path, "vm", "libvirt", runs=VM_RUNS)


def test_write_section() -> None:
    """Runs last in this module: renders what the tests above measured."""
    if not RESULTS:
        pytest.skip("nothing measured")
    lines = [
        BEGIN,
        "## Request to running (whole control loop)",
        "",
        "From the `requested` to the `running` event of one sandbox, through the real control",
        "worker, host agent (simulated GPUs) and sandbox driver, PostgreSQL and Redis, one",
        f"request at a time; {RUNS} runs ({VM_RUNS} for VMs) after one warm-up. Measured by `make bench`",
        f"(`pytest -m bench tests/bench`) on the development machine ({os.cpu_count()} cores).",
        "",
        "| isolation | driver | median (s) | p90 (s) | max (s) | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    drivers = {"container": "docker", "process": "process (bubblewrap)", "vm": "libvirt (QEMU TCG)"}
    for isolation, values in RESULTS.items():
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        lines.append(
            f"| {isolation} | {drivers[isolation]} | {statistics.median(values):.3f} | {p90:.3f} | "
            f"{max(values):.3f} | {TARGETS[isolation]} |"
        )
    if "vm" in RESULTS:
        lines += [
            "",
            "VMs run under QEMU TCG (`LIBVIRT_DOMAIN_TYPE=qemu`: this machine's KVM cannot run",
            "guests). The figure ends when libvirt reports the domain running, not when the guest",
            "has booted. It needs /dev/kvm as Debian's udev sets it (root:kvm 0660, which `.ci/run`",
            "restores): root-only, libvirt re-probes QEMU on every domain definition (~40 s each).",
        ]
    lines.append(END)
    section = "\n".join(lines)
    print(section)
    if os.environ.get("BENCH_OUT"):
        write_section(ROOT / os.environ["BENCH_OUT"], section)
