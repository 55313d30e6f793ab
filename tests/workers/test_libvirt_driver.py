"""libvirt driver: spec -> domain XML (no libvirt), then real VMs under QEMU (TCG here).

The engine tests boot the guest that ``scripts/build-vm-image.sh`` builds (a small kernel
and a busybox initramfs). Under TCG a boot takes seconds to tens of seconds, so every wait
polls with a generous deadline; nothing here asserts on speed.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.engines import require_engine, require_module

libvirt = require_module("libvirt", "libvirt-python (make install-libvirt)")
# After the check above: without the optional extra the module is skipped (failed in CI).
from wire import uids  # noqa: E402
from wire.spec import SandboxHandle, SandboxSpec  # noqa: E402
from workers.drivers import make_driver  # noqa: E402
from workers.drivers.base import DriverError  # noqa: E402
from workers.drivers.libvirt import (  # noqa: E402
    METADATA_NS,
    ConsoleTerminal,
    GuestImage,
    LibvirtDriver,
    domain_name,
    domain_uuid,
    domain_xml,
    guest_script,
    kvm_usable,
    labels_from_metadata,
    libvirt_available,
    normalize_pci_address,
)
from workers.drivers.storage import BoundStorage  # noqa: E402

IMAGE = GuestImage(kernel=Path("/images/vmlinuz"), initrd=Path("/images/initramfs.cpio.gz"))
BOOT_DEADLINE_S = 240.0  # TCG on a busy two-core machine: generous, never asserted on


def make_spec(host: str = "h1", **overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "allocation_key": f"t{uuid.uuid4().hex[:12]}",
        "sandbox_id": 42,
        "host": host,
        "project": "proj",
        "owner": "alice",
        "image": "ignored-by-libvirt",
        "command": ("sleep", "600"),
        "device_uuids": ("GPU-aaaa",),
        "real_gpu": False,
        "cpu_limit": 0.5,
        "memory_limit_mib": 128,
        "pids_limit": 64,
        "env": {"FOO": "bar baz"},
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


def parse(spec: SandboxSpec, domain_type: str = "qemu", **kwargs: object) -> ET.Element:
    xml = domain_xml(spec, image=IMAGE, domain_type=domain_type, **kwargs)  # type: ignore[arg-type]
    return ET.fromstring(xml)  # noqa: S314 - our own XML


def text(root: ET.Element, path: str) -> str:
    found = root.find(path)
    assert found is not None, path
    return found.text or ""


# --- no libvirt needed -------------------------------------------------------------------


def test_xml_name_limits_and_boot() -> None:
    spec = make_spec()
    root = parse(spec)
    assert root.get("type") == "qemu"
    assert text(root, "name") == f"gpushare-{spec.allocation_key}"
    assert text(root, "uuid") == domain_uuid(spec.allocation_key)
    assert root.find("memory").attrib == {"unit": "MiB"}  # type: ignore[union-attr]
    assert text(root, "memory") == text(root, "currentMemory") == "128"
    assert text(root, "vcpu") == "1"  # ceil(0.5)
    assert text(parse(make_spec(cpu_limit=2.5)), "vcpu") == "3"
    assert text(root, "os/kernel") == "/images/vmlinuz"
    assert text(root, "os/initrd") == "/images/initramfs.cpio.gz"
    assert root.find("features/acpi") is not None
    assert {text(root, e) for e in ("on_poweroff", "on_reboot", "on_crash")} == {"destroy"}


def test_xml_command_travels_on_the_kernel_cmdline() -> None:
    spec = make_spec(command=("sh", "-c", "echo 'it works'; exit 3"))
    cmdline = text(parse(spec), "os/cmdline")
    assert "console=ttyS0" in cmdline.split()
    (encoded,) = (
        arg.removeprefix("gpushare.run=") for arg in cmdline.split() if arg.startswith("gpushare.run=")
    )
    script = base64.b64decode(encoded).decode()
    assert script == guest_script(spec)
    assert "export FOO='bar baz'" in script
    assert "export NVIDIA_VISIBLE_DEVICES=GPU-aaaa" in script
    assert script.endswith("exec sh -c 'echo '\"'\"'it works'\"'\"'; exit 3'\n")
    # No command: the guest starts a shell on its console.
    assert "gpushare.run=" not in text(parse(make_spec(command=())), "os/cmdline")


def test_xml_rejects_a_command_too_long_for_the_kernel() -> None:
    with pytest.raises(DriverError, match="kernel command line"):
        parse(make_spec(command=("echo", "x" * 3000)))


def test_xml_serial_console_and_no_graphics() -> None:
    root = parse(make_spec(), console_log=Path("/var/log/libvirt/qemu/x.console.log"))
    assert root.find("devices/serial").get("type") == "pty"  # type: ignore[union-attr]
    assert root.find("devices/serial/log").attrib == {  # type: ignore[union-attr]
        "file": "/var/log/libvirt/qemu/x.console.log",
        "append": "off",
    }
    console = root.find("devices/console")
    assert console is not None and console.get("type") == "pty"
    assert console.find("target").attrib == {"type": "serial", "port": "0"}  # type: ignore[union-attr]
    for absent in ("graphics", "video", "sound", "input", "hostdev"):
        assert root.find(f"devices/{absent}") is None, absent
    assert root.find("devices/memballoon").get("model") == "none"  # type: ignore[union-attr]


def test_xml_no_interface_without_network() -> None:
    assert parse(make_spec(network=False)).find("devices/interface") is None


def test_xml_interface_with_network() -> None:
    root = parse(make_spec(network=True), network_name="sandboxes")
    (iface,) = root.findall("devices/interface")
    assert iface.get("type") == "network"
    assert iface.find("source").attrib == {"network": "sandboxes"}  # type: ignore[union-attr]
    assert iface.find("model").attrib == {"type": "virtio"}  # type: ignore[union-attr]


def test_xml_vfio_hostdevs_from_the_resolver() -> None:
    addresses = {"GPU-aaaa": "0000:3b:00.0", "GPU-bbbb": "0000:AF:1f.7"}
    spec = make_spec(real_gpu=True, device_uuids=tuple(addresses))
    hostdevs = parse(spec, resolve_pci=addresses.__getitem__).findall("devices/hostdev")
    assert [h.attrib for h in hostdevs] == [{"mode": "subsystem", "type": "pci", "managed": "yes"}] * 2
    assert [h.find("source/address").attrib for h in hostdevs] == [  # type: ignore[union-attr]
        {"domain": "0x0000", "bus": "0x3b", "slot": "0x00", "function": "0x0"},
        {"domain": "0x0000", "bus": "0xaf", "slot": "0x1f", "function": "0x7"},
    ]
    # Simulated hosts pass nothing through, whatever the resolver says.
    assert (
        parse(make_spec(device_uuids=tuple(addresses)), resolve_pci=addresses.__getitem__).find(
            "devices/hostdev"
        )
        is None
    )


def test_xml_cpu_only_passes_no_gpu_through() -> None:
    """A CPU-only sandbox names no device: even on a host with real GPUs (and no resolver)
    the VM gets no hostdev, and its command sees no GPU."""
    spec = make_spec(real_gpu=True, device_uuids=())
    root = parse(spec)
    assert root.find("devices/hostdev") is None
    assert "export NVIDIA_VISIBLE_DEVICES=void" in guest_script(spec)


def test_nvmls_bus_id_is_a_pci_address() -> None:
    """NVML's busId has an 8-hex-digit domain; the resolver may hand it over as it is."""
    assert normalize_pci_address("GPU-a", "00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_address("GPU-a", " 0001:af:1f.7\n") == "0001:af:1f.7"
    spec = make_spec(real_gpu=True)
    hostdev = parse(spec, resolve_pci=lambda _uuid: "00000000:3B:00.0").find("devices/hostdev/source/address")
    assert hostdev is not None
    assert hostdev.attrib == {"domain": "0x0000", "bus": "0x3b", "slot": "0x00", "function": "0x0"}
    for bad in ("00010000:3b:00.0", "000:3b:00.0", "0000:3b:00.8", "3b:00.0"):
        with pytest.raises(DriverError, match="not a PCI address"):
            normalize_pci_address("GPU-a", bad)


def test_a_vm_with_a_real_gpu_is_refused_before_anything_is_defined(tmp_path: Path) -> None:
    """Passthrough cannot work yet (no NVIDIA driver in the guest, a PCI hole smaller than
    the BAR, no drain before the unbind): refused, saying so, not hung in an unbind."""
    image = GuestImage(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd")
    driver = LibvirtDriver(
        host="h1", uri="test:///nonexistent", image=image, domain_type="qemu",
        resolve_pci=lambda _uuid: "0000:3b:00.0",
    )  # fmt: skip
    with pytest.raises(DriverError) as refused:
        driver.launch(make_spec(real_gpu=True))
    assert "passed-through GPU are not supported yet" in str(refused.value)
    assert "docs/gpu-hosts.md" in str(refused.value)
    assert driver._conn is None  # libvirt was never even asked


def test_xml_vfio_errors_name_the_problem() -> None:
    with pytest.raises(DriverError, match="no PCI resolver"):
        parse(make_spec(real_gpu=True))
    with pytest.raises(DriverError, match="not a PCI address"):
        parse(make_spec(real_gpu=True), resolve_pci=lambda _uuid: "3b:00")
    with pytest.raises(DriverError, match="MIG instances"):
        parse(make_spec(real_gpu=True, device_uuids=("MIG-cccc",)), resolve_pci=lambda _uuid: "0000:3b:00.0")


def test_xml_metadata_carries_the_labels() -> None:
    spec = make_spec(device_uuids=("GPU-aaaa", "GPU-bbbb"))
    xml = domain_xml(spec, image=IMAGE, domain_type="qemu", launched_ms=1234)
    sandbox = ET.fromstring(xml).find(  # noqa: S314 - our own XML
        f"metadata/{{{METADATA_NS}}}sandbox"
    )
    assert sandbox is not None
    assert labels_from_metadata(ET.tostring(sandbox, encoding="unicode")) == (spec.labels(), 1234)
    assert labels_from_metadata(xml) == (spec.labels(), 1234)


def test_xml_domain_type() -> None:
    kvm = parse(make_spec(), domain_type="kvm")
    assert kvm.get("type") == "kvm"
    assert kvm.find("cpu").attrib == {"mode": "host-passthrough"}  # type: ignore[union-attr]
    tcg = parse(make_spec(), domain_type="qemu")
    assert tcg.get("type") == "qemu" and tcg.find("cpu") is None
    with pytest.raises(ValueError, match="'xen'"):
        parse(make_spec(), domain_type="xen")
    assert kvm_usable("/nonexistent/kvm") is False


def test_driver_configuration_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIBVIRT_URI", "qemu:///session")
    monkeypatch.setenv("VM_KERNEL", "/k/vmlinuz")
    monkeypatch.delenv("VM_INITRD", raising=False)
    monkeypatch.setenv("GPUSHARE_VAR_DIR", str(tmp_path))
    driver = make_driver("libvirt", "h1", tmp_path)  # opens no connection
    assert isinstance(driver, LibvirtDriver)
    assert driver.uri == "qemu:///session" and driver.host == "h1"
    assert driver.image == GuestImage(Path("/k/vmlinuz"), tmp_path.resolve() / "vm" / "initramfs.cpio.gz")
    assert driver.console_log("a1") is None  # only qemu:///system logs the console for us
    monkeypatch.setenv("LIBVIRT_DOMAIN_TYPE", "qemu")  # KVM that cannot run guests: TCG
    assert LibvirtDriver("h1").domain_type == "qemu"
    monkeypatch.setenv("LIBVIRT_DOMAIN_TYPE", "xen")
    with pytest.raises(DriverError, match="LIBVIRT_DOMAIN_TYPE='xen': use auto, kvm or qemu"):
        LibvirtDriver("h1")
    monkeypatch.setenv("LIBVIRT_DOMAIN_TYPE", "qemu")
    assert LibvirtDriver(uri="qemu:///system", domain_type="qemu").console_log("a1") == Path(
        "/var/log/libvirt/qemu/gpushare-a1.console.log"
    )


def test_unreachable_libvirt_is_a_driver_error() -> None:
    uri = "qemu+unix:///system?socket=/nonexistent/libvirt-sock"
    assert libvirt_available(uri) is False
    with pytest.raises(DriverError, match="cannot reach libvirt"):
        LibvirtDriver(uri=uri, domain_type="qemu").list_owned()


# --- against a real libvirtd and QEMU ----------------------------------------------------


@pytest.fixture(scope="module")
def guest() -> GuestImage:
    require_engine(libvirt_available(), "libvirtd (LIBVIRT_URI or qemu:///system)")
    image = GuestImage.from_env()
    missing = image.missing()
    require_engine(not missing, f"VM guest image {missing} (build it with scripts/build-vm-image.sh)")
    return image


@pytest.fixture
def host(guest: GuestImage) -> Iterator[str]:
    """A host name no one else uses, so that list_owned and cleanup see only our domains."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    cleaner = LibvirtDriver(name, image=guest)
    for handle in cleaner.list_owned():
        cleaner.stop(handle, grace_s=0)


@pytest.fixture
def driver(guest: GuestImage, host: str) -> LibvirtDriver:
    return LibvirtDriver(host, image=guest)


def console_text(driver: LibvirtDriver, allocation_key: str) -> str:
    path = driver.console_log(allocation_key)
    assert path is not None, "these tests need qemu:///system, which logs the console"
    try:
        return path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


def wait_for_console(driver: LibvirtDriver, allocation_key: str, pattern: str) -> str:
    deadline = time.monotonic() + BOOT_DEADLINE_S
    while time.monotonic() < deadline:
        out = console_text(driver, allocation_key)
        if re.search(pattern, out):
            return out
        time.sleep(0.5)
    pytest.fail(
        f"no {pattern!r} on the console in {BOOT_DEADLINE_S} s:\n{console_text(driver, allocation_key)}"
    )


def wait_for_state(driver: LibvirtDriver, handle: SandboxHandle, state: str) -> None:
    deadline = time.monotonic() + BOOT_DEADLINE_S
    while driver.status(handle).state != state:
        assert time.monotonic() < deadline, f"sandbox never reached {state}"
        time.sleep(0.5)


def qemu_uid(name: str) -> int | None:
    try:
        pid = int(Path(f"/run/libvirt/qemu/{name}.pid").read_text())
        return Path(f"/proc/{pid}").stat().st_uid
    except (OSError, ValueError):
        return None


def read_until(terminal: ConsoleTerminal, pattern: bytes, timeout_s: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not re.search(pattern, out):
        out += terminal.read(0.5)
    return out


@pytest.mark.libvirt
@pytest.mark.slow
def test_vm_boots_is_idempotent_listed_and_stopped(driver: LibvirtDriver, host: str) -> None:
    spec = make_spec(host)
    handle = driver.launch(spec)
    name = domain_name(spec.allocation_key)
    assert handle.driver == "libvirt" and handle.allocation_key == spec.allocation_key
    assert handle.ref == domain_uuid(spec.allocation_key) and handle.sandbox_id == 42

    started = time.monotonic()
    wait_for_console(driver, spec.allocation_key, r"gpushare-guest: up")
    print(f"guest up {time.monotonic() - started:.1f} s after launch ({driver.domain_type})")
    status = driver.status(handle)
    assert status.state == "running" and status.started_at_ms is not None
    uid = qemu_uid(name)
    assert uid is None or uid != 0, "QEMU runs as root"

    assert driver.launch(spec) == handle  # the same domain, not a second one
    names = [d.name() for d in driver.conn.listAllDomains(0)]
    assert names.count(name) == 1
    assert driver.list_owned() == [handle]
    assert LibvirtDriver(f"other-{host}", image=driver.image).list_owned() == []
    assert handle in LibvirtDriver("", image=driver.image).list_owned()  # no host: all of ours

    driver.stop(handle, grace_s=30)
    assert driver.status(handle).state == "missing"
    with pytest.raises(libvirt.libvirtError):
        driver.conn.lookupByName(name)
    driver.stop(handle, grace_s=0)  # idempotent
    assert driver.list_owned() == []


@pytest.mark.libvirt
@pytest.mark.slow
def test_finished_command_leaves_the_vm_exited(driver: LibvirtDriver, host: str) -> None:
    spec = make_spec(host, command=("sh", "-c", 'echo "hello as $(id -u) $FOO"; exit 3'))
    handle = driver.launch(spec)
    wait_for_state(driver, handle, "exited")
    status = driver.status(handle)
    assert status.exit_code == 3
    out = console_text(driver, spec.allocation_key)
    assert "hello as 1000 bar baz" in out
    assert driver.launch(spec) == handle  # a repeated message does not rerun it
    assert driver.status(handle).state == "exited"
    driver.stop(handle)
    assert driver.status(handle).state == "missing"


@pytest.mark.libvirt
@pytest.mark.slow
def test_acpi_shutdown_stops_the_command(driver: LibvirtDriver, host: str) -> None:
    spec = make_spec(host)
    handle = driver.launch(spec)
    wait_for_console(driver, spec.allocation_key, r"gpushare-guest: up")
    time.sleep(1)  # acpid starts just before the up line
    driver.conn.lookupByUUIDString(handle.ref).shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
    wait_for_state(driver, handle, "exited")
    assert driver.status(handle).exit_code == 143  # SIGTERM, then a clean power-off


@pytest.mark.libvirt
@pytest.mark.slow
def test_terminal_over_the_serial_console(driver: LibvirtDriver, host: str) -> None:
    spec = make_spec(host, command=())  # no command: a shell on the console
    handle = driver.launch(spec)
    wait_for_console(driver, spec.allocation_key, r"gpushare-guest: up")
    terminal = driver.exec_terminal(handle)
    try:
        terminal.resize(40, 120)  # a no-op on a serial console, but allowed
        out = b""
        deadline = time.monotonic() + BOOT_DEADLINE_S
        while b"id=1000 answer=42" not in out and time.monotonic() < deadline:
            terminal.write(b'echo "id=$(id -u) answer=$((6 * 7))"\n')
            out += read_until(terminal, rb"id=1000 answer=42", timeout_s=15)
        assert b"id=1000 answer=42" in out
        terminal.write(b"exit\n")  # the shell ends, the guest powers off
        with pytest.raises(EOFError):
            while True:
                terminal.read(0.5)
                assert time.monotonic() < deadline + BOOT_DEADLINE_S
    finally:
        terminal.close()
    wait_for_state(driver, handle, "exited")
    with pytest.raises(DriverError, match="shut off"):
        driver.exec_terminal(handle)


def test_a_vm_shares_exactly_its_resolved_storage_as_its_own_uid() -> None:
    spec = make_spec(sandbox_id=55)
    bound = [
        BoundStorage("/srv/storage/homes/3", "/home/sandbox", False, 1_002_000_003, 3),
        BoundStorage("/srv/storage/datasets/mnist", "/data/mnist", True, 0, 0),
    ]
    root = ET.fromstring(domain_xml(spec, image=IMAGE, domain_type="qemu", bound=bound))  # noqa: S314
    shares = [(f.find("driver"), f.find("source")) for f in root.findall("devices/filesystem")]
    assert [(d.get("type"), s.get("dir")) for d, s in shares] == [  # type: ignore[union-attr]
        ("virtiofs", "/srv/storage/homes/3"),
        ("virtiofs", "/srv/storage/datasets/mnist"),
    ]
    assert root.find("memoryBacking/access").get("mode") == "shared"  # type: ignore[union-attr]
    cmdline = root.findtext("os/cmdline") or ""
    assert f"gpushare.uid={uids.sandbox_uid(55)} gpushare.gid=1002000003" in cmdline
    mounts = base64.b64decode(re.search(r"gpushare\.mounts=(\S+)", cmdline).group(1)).decode()  # type: ignore[union-attr]
    assert mounts == "gpushare0 rw /home/sandbox\ngpushare1 ro /data/mnist\n"
    # No storage: no share, and no shared memory.
    plain = ET.fromstring(domain_xml(spec, image=IMAGE, domain_type="qemu"))  # noqa: S314
    assert plain.find("devices/filesystem") is None and plain.find("memoryBacking") is None
    # virtiofsd creates as the guest's one gid: one read-write volume at most.
    two = [*bound, BoundStorage("/srv/storage/projects/1", "/project", False, 1_002_000_004, 4)]
    with pytest.raises(DriverError, match="one read-write storage at most"):
        domain_xml(spec, image=IMAGE, domain_type="qemu", bound=two)
