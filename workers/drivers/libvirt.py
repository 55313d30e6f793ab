"""libvirt sandbox driver: one QEMU virtual machine per allocation (the ``vm`` isolation level).

Each sandbox is a persistent libvirt domain named ``gpushare-<allocation_key>`` whose UUID
is derived from the allocation id, so a repeated or concurrent launch defines the very
same domain instead of a second one. The domain XML comes from ``domain_xml``, a pure
function of the spec:

* memory = ``memory_limit_mib`` (no balloon), vcpus = ``ceil(cpu_limit)``;
* type ``kvm`` when /dev/kvm can really create a VM, else ``qemu`` (TCG, slow but works
  anywhere, which is what the tests run on); ``LIBVIRT_DOMAIN_TYPE`` overrides the guess
  for hosts whose KVM creates VMs but cannot run them (nested or restricted CPUs);
* direct kernel boot of ``VM_KERNEL`` + ``VM_INITRD`` (``scripts/build-vm-image.sh`` builds
  both); the sandbox command, with its environment, travels base64-encoded on the kernel
  command line (``gpushare.run=``) and the guest's init runs it, then powers off, so a
  finished command leaves the domain shut off (state ``exited``); with no command the
  guest starts a shell on the console;
* a serial console on a pty (``exec_terminal`` attaches to it) whose output libvirt also
  copies to a log file, from which ``status`` reads the command's exit code;
* no network interface unless ``spec.network``; no graphics, USB or balloon devices;
* on real GPU hosts, one VFIO ``<hostdev>`` per dedicated GPU, at the PCI address an
  injectable resolver gives for its UUID (MIG instances cannot be passed through). Not
  reachable yet: ``launch`` refuses a real GPU (``GPU_PASSTHROUGH_UNSUPPORTED``), because
  the rest of what passthrough needs is missing (docs/gpu-hosts.md).
* ``<metadata>`` in the gpushare namespace holding ``spec.labels()``, from which
  ``list_owned`` rebuilds the agent's picture after a restart.

Least privilege on the host: with ``qemu:///system`` libvirt runs each QEMU process as its
unprivileged user (``libvirt-qemu`` on Debian, see ``user``/``group`` in qemu.conf) and
relabels the kernel and initramfs for it; the driver asks for no extra privileges. In the
guest the command runs as uid 1000 (see the image script).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import math
import os
import re
import shlex
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire import uids
from workers.drivers import storage

try:
    import libvirt
except ImportError as exc:  # an optional extra: the pure builders below work without it
    _LIBVIRT_MISSING: ImportError | None = exc
else:
    _LIBVIRT_MISSING = None
from wire.config import storage_root, var_dir
from wire.spec import LABEL_PREFIX, SandboxHandle, SandboxSpec
from workers.drivers.base import DriverError, SandboxStatus
from workers.drivers.output import OutputChunk
from workers.drivers.storage import BoundStorage
from workers.drivers.unavailable import DriverUnavailable, install_command

log = logging.getLogger(__name__)

DEFAULT_URI = "qemu:///system"
METADATA_NS = "https://gpushare.dev/xmlns/sandbox/1"
METADATA_PREFIX = "gpushare"
ALLOCATION_LABEL = f"{LABEL_PREFIX}.allocation"
BUILD_HINT = "build them with scripts/build-vm-image.sh"
# UUIDs of sandbox domains: uuid5(namespace, allocation id).
_UUID_NAMESPACE = uuid.UUID("6f1c2b0e-7f55-4c59-9a43-2d1d8f0f5a11")
# x86 COMMAND_LINE_SIZE is 2048 bytes; leave room for what the kernel appends.
_MAX_CMDLINE = 2000
_BASE_CMDLINE = "console=ttyS0 panic=-1 quiet"
# NVML's busId has an 8-hex-digit domain ("00000000:3B:00.0"), sysfs and libvirt 4 digits.
_PCI_ADDRESS = re.compile(
    r"(?P<domain>[0-9a-fA-F]{8}|[0-9a-fA-F]{4}):(?P<bus>[0-9a-fA-F]{2}):(?P<slot>[0-9a-fA-F]{2})"
    r"\.(?P<function>[0-7])"
)
GPU_PASSTHROUGH_UNSUPPORTED = (
    "VM sandboxes with a passed-through GPU are not supported yet: the guest image has no "
    "NVIDIA driver, the domain's 64-bit PCI hole is smaller than the GPU's BAR, and nothing "
    "drains the GPU before libvirt unbinds it (see docs/gpu-hosts.md). Give GPU tiers container "
    "or process isolation; VM isolation serves CPU-only sandboxes on this host"
)
_EXIT_LINE = re.compile(rb"gpushare-guest: exit (\d+)")
# /dev/kvm ioctls (linux/kvm.h): _IO(0xAE, 0x00) and _IO(0xAE, 0x01).
_KVM_GET_API_VERSION = 0xAE00
_KVM_CREATE_VM = 0xAE01
_KVM_API_VERSION = 12
_POLL_S = 0.2
# virDomainState values (libvirt's stable C ABI; numbers, so this module imports without
# libvirt-python): running, blocked, paused, shutdown (shutting down: still running),
# pmsuspended.
_LIVE_STATES = frozenset({1, 2, 3, 4, 7})

PciResolver = Callable[[str], str]  # GPU UUID -> "0000:3b:00.0"


def domain_name(allocation_key: str) -> str:
    return f"gpushare-{allocation_key}"


def domain_uuid(allocation_key: str) -> str:
    return str(uuid.uuid5(_UUID_NAMESPACE, allocation_key))


def kvm_usable(path: str = "/dev/kvm") -> bool:
    """True when QEMU could use ``path`` to create a VM.

    A /dev/kvm node is not enough: nested or restricted hosts have it but fail
    KVM_CREATE_VM, and containers often have it root-only (0600), which the unprivileged
    user libvirt runs QEMU as cannot open. So the node must grant read-write beyond its
    owner (0660 root:kvm is the usual) and really create a VM.
    """
    try:
        if os.stat(path).st_mode & 0o066 not in (0o060, 0o066, 0o006):
            return False
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if fcntl.ioctl(fd, _KVM_GET_API_VERSION, 0) != _KVM_API_VERSION:
            return False
        vm_fd = fcntl.ioctl(fd, _KVM_CREATE_VM, 0)
        os.close(vm_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def configured_domain_type() -> str:
    """``LIBVIRT_DOMAIN_TYPE``: ``kvm``, ``qemu`` (TCG), or ``auto`` (kvm when usable)."""
    wanted = os.environ.get("LIBVIRT_DOMAIN_TYPE", "auto") or "auto"
    if wanted not in ("auto", "kvm", "qemu"):
        raise DriverError(f"LIBVIRT_DOMAIN_TYPE={wanted!r}: use auto, kvm or qemu")
    if wanted == "auto":
        return "kvm" if kvm_usable() else "qemu"
    return wanted


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path

    @classmethod
    def from_env(cls) -> GuestImage:
        """``VM_KERNEL`` / ``VM_INITRD``, by default what build-vm-image.sh writes."""
        default = var_dir() / "vm"
        return cls(
            kernel=Path(os.environ.get("VM_KERNEL") or default / "vmlinuz"),
            initrd=Path(os.environ.get("VM_INITRD") or default / "initramfs.cpio.gz"),
        )

    def missing(self) -> list[str]:
        return [str(p) for p in (self.kernel, self.initrd) if not os.access(p, os.R_OK)]


# --- domain XML (pure) -------------------------------------------------------------------


def guest_script(spec: SandboxSpec) -> str:
    """The shell script the guest's init runs as the sandbox user: environment, then the
    command (exec'd, so its exit code is the sandbox's)."""
    env = {**spec.env, **spec.gpu_env()}
    lines = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    lines.append(f"exec {shlex.join(spec.command)}")
    return "\n".join(lines) + "\n"


def storage_identity(spec: SandboxSpec, bound: Sequence[BoundStorage]) -> tuple[int, int]:
    """(uid, gid) a VM with storage runs as, QEMU on the host and its user in the guest: the
    sandbox's own uid, as the other drivers give it, and its read-write volume's group. QEMU
    gets no supplementary groups, so a VM takes one read-write volume at most."""
    writable = [m for m in bound if not m.read_only]
    if len(writable) > 1:
        raise DriverError(
            f"sandbox {spec.allocation_key}: a VM mounts one read-write storage at most, not "
            f"{len(writable)} ({', '.join(m.target for m in writable)})"
        )
    uid = uids.host_uid(spec)
    return uid, writable[0].gid if writable else uid


def kernel_cmdline(spec: SandboxSpec, bound: Sequence[BoundStorage] = ()) -> str:
    cmdline = _BASE_CMDLINE
    if bound:
        uid, gid = storage_identity(spec, bound)
        lines = "".join(
            f"gpushare{i} {'ro' if m.read_only else 'rw'} {m.target}\n" for i, m in enumerate(bound)
        )
        cmdline += f" gpushare.uid={uid} gpushare.gid={gid}"
        cmdline += f" gpushare.mounts={base64.b64encode(lines.encode()).decode()}"
    if spec.command:  # else the guest starts a shell on the console
        cmdline += f" gpushare.run={base64.b64encode(guest_script(spec).encode()).decode()}"
    if len(cmdline) > _MAX_CMDLINE:
        raise DriverError(
            f"sandbox {spec.allocation_key}: command and environment take {len(cmdline)} bytes on "
            f"the kernel command line, more than the {_MAX_CMDLINE} it holds"
        )
    return cmdline


def normalize_pci_address(device_uuid: str, address: str) -> str:
    """``0000:3b:00.0`` from sysfs' form or NVML's (``00000000:3B:00.0``, 8-digit domain)."""
    match = _PCI_ADDRESS.fullmatch(address.strip())
    if match is None or int(match["domain"], 16) > 0xFFFF:
        raise DriverError(f"GPU {device_uuid}: {address!r} is not a PCI address like 0000:3b:00.0")
    domain = int(match["domain"], 16)
    return f"{domain:04x}:{match['bus'].lower()}:{match['slot'].lower()}.{match['function']}"


def pci_address(device_uuid: str, address: str) -> dict[str, str]:
    """libvirt ``<address>`` attributes for a PCI address such as ``0000:3b:00.0`` (or
    NVML's ``00000000:3B:00.0``)."""
    domain, bus, slot_function = normalize_pci_address(device_uuid, address).split(":")
    slot, function = slot_function.split(".")
    return {"domain": f"0x{domain}", "bus": f"0x{bus}", "slot": f"0x{slot}", "function": f"0x{function}"}


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    child = ET.SubElement(parent, tag, attrs)
    if text is not None:
        child.text = text
    return child


def domain_xml(
    spec: SandboxSpec,
    *,
    image: GuestImage,
    domain_type: str,
    resolve_pci: PciResolver | None = None,
    console_log: Path | None = None,
    network_name: str = "default",
    launched_ms: int | None = None,
    bound: Sequence[BoundStorage] = (),
) -> str:
    """The libvirt domain XML for ``spec`` and its storage, resolved on this host (pure, so it
    is unit-testable without libvirt)."""
    if domain_type not in ("kvm", "qemu"):
        raise ValueError(f"domain type must be kvm or qemu, not {domain_type!r}")
    dom = ET.Element("domain", type=domain_type)
    _sub(dom, "name", domain_name(spec.allocation_key))
    _sub(dom, "uuid", domain_uuid(spec.allocation_key))
    _sub(dom, "title", f"gpushare sandbox {spec.sandbox_id}")
    _sub(dom, "description", f"sandbox {spec.sandbox_id} of {spec.owner} in project {spec.project}")

    metadata = _sub(dom, "metadata")
    sandbox = _sub(metadata, f"{{{METADATA_NS}}}sandbox")
    if launched_ms is not None:
        sandbox.set("launched-ms", str(launched_ms))
    for key, value in spec.labels().items():
        _sub(sandbox, f"{{{METADATA_NS}}}label", value, name=key)

    memory = str(spec.memory_limit_mib)
    _sub(dom, "memory", memory, unit="MiB")
    _sub(dom, "currentMemory", memory, unit="MiB")
    _sub(dom, "vcpu", str(max(1, math.ceil(spec.cpu_limit))), placement="static")

    os_el = _sub(dom, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine="pc")
    _sub(os_el, "kernel", str(image.kernel))
    _sub(os_el, "initrd", str(image.initrd))
    _sub(os_el, "cmdline", kernel_cmdline(spec, bound))
    features = _sub(dom, "features")
    _sub(features, "acpi")  # libvirt's shutdown presses the ACPI power button
    if domain_type == "kvm":
        _sub(dom, "cpu", mode="host-passthrough")
    # The guest powers off when its command ends; a reboot or crash ends the sandbox too.
    for event in ("on_poweroff", "on_reboot", "on_crash"):
        _sub(dom, event, "destroy")

    devices = _sub(dom, "devices")
    serial = _sub(devices, "serial", type="pty")
    if console_log is not None:
        _sub(serial, "log", file=str(console_log), append="off")
    _sub(serial, "target", port="0")
    console = _sub(devices, "console", type="pty")
    _sub(console, "target", type="serial", port="0")
    if spec.network:
        iface = _sub(devices, "interface", type="network")
        _sub(iface, "source", network=network_name)
        _sub(iface, "model", type="virtio")
    if spec.real_gpu:  # no hostdev at all for a CPU-only sandbox (no device UUIDs)
        for device_uuid in spec.device_uuids:
            if not device_uuid.startswith("GPU-"):
                raise DriverError(
                    f"{device_uuid} cannot be passed to a VM: VFIO passes whole GPUs only "
                    "(MIG instances need the docker or process driver)"
                )
            if resolve_pci is None:
                raise DriverError(f"no PCI resolver: cannot pass GPU {device_uuid} through to a VM")
            hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
            _sub(_sub(hostdev, "source"), "address", **pci_address(device_uuid, resolve_pci(device_uuid)))
    if bound:
        storage_identity(spec, bound)  # refuses a second read-write volume
        # virtiofs: libvirt runs virtiofsd on the host for each share, which creates files as
        # the guest's user (the sandbox's uid, the volume's gid; the guest's kernel checks
        # permissions as they are on the host). It needs the guest's RAM shared with it.
        backing = ET.Element("memoryBacking")
        _sub(backing, "source", type="memfd")
        _sub(backing, "access", mode="shared")
        dom.insert(list(dom).index(dom.find("vcpu")), backing)  # type: ignore[arg-type]
    for index, mount in enumerate(bound):
        # libvirt 9 takes no <readonly/> for virtiofs: a dataset is mounted read-only by the
        # guest, whose sandbox user is not root, and is root's on the host besides.
        share = _sub(devices, "filesystem", type="mount", accessmode="passthrough")
        _sub(share, "driver", type="virtiofs")
        _sub(share, "source", dir=mount.host_path)
        _sub(share, "target", dir=f"gpushare{index}")
    _sub(devices, "controller", type="usb", model="none")
    _sub(devices, "memballoon", model="none")

    ET.register_namespace(METADATA_PREFIX, METADATA_NS)
    return ET.tostring(dom, encoding="unicode")


def labels_from_metadata(xml: str) -> tuple[dict[str, str], int | None]:
    """(labels, launch time in epoch ms) from the gpushare ``<metadata>`` element.

    Accepts the whole domain XML or the element alone, as ``virDomainGetMetadata``
    returns it: without its namespace, so elements are matched by local name.
    """
    root = ET.fromstring(xml)  # noqa: S314 - libvirt's echo of the element we wrote

    def local(tag: str) -> str:
        return tag.rpartition("}")[2]

    sandbox = next((el for el in root.iter() if local(el.tag) == "sandbox"), None)
    if sandbox is None:
        return {}, None
    labels = {name: el.text or "" for el in sandbox if local(el.tag) == "label" and (name := el.get("name"))}
    launched = sandbox.get("launched-ms")
    return labels, int(launched) if launched and launched.isdigit() else None


# --- libvirt plumbing --------------------------------------------------------------------

_event_loop_lock = threading.Lock()
_event_loop_started = False


def _ensure_event_loop() -> None:
    """libvirt's default event loop, run by one daemon thread per process: console streams
    (non-blocking, so ``read`` can time out) and keepalives need it. It must be registered
    before the first connection is opened."""
    global _event_loop_started
    with _event_loop_lock:
        if _event_loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _event_loop_started = True


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt prints every error on stderr by default; ours become DriverErrors instead."""


def _code(exc: libvirt.libvirtError) -> int:
    return int(exc.get_error_code() or 0)


@contextlib.contextmanager
def _libvirt_errors(action: str) -> Iterator[None]:
    """Turn libvirt errors into DriverError naming what we were doing."""
    try:
        yield
    except libvirt.libvirtError as exc:
        message = exc.get_error_message() or str(exc)
        raise DriverError(f"{action}: libvirt refused: {message}") from exc


def _missing(exc: libvirt.libvirtError) -> bool:
    return _code(exc) == int(libvirt.VIR_ERR_NO_DOMAIN)


def _exit_code(log_path: Path | None) -> int | None:
    if log_path is None:
        return None
    try:
        found = _EXIT_LINE.findall(log_path.read_bytes()[-65536:])
    except OSError:
        return None
    return int(found[-1]) if found else None


# --- terminal ----------------------------------------------------------------------------


class ConsoleTerminal:
    """The domain's serial console, through a non-blocking libvirt stream.

    ``read`` returns ``b""`` when nothing arrived within the timeout and raises
    ``EOFError`` once the console has gone (domain shut off or destroyed). The console is
    the guest's ttyS0: the shell the guest started, or the command's own stdin.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._readable = threading.Event()
        self._closed = False
        stream.eventAddCallback(
            libvirt.VIR_STREAM_EVENT_READABLE
            | libvirt.VIR_STREAM_EVENT_ERROR
            | libvirt.VIR_STREAM_EVENT_HANGUP,
            self._on_event,
            None,
        )

    def _on_event(self, _stream: Any, _events: int, _opaque: object) -> None:
        self._readable.set()  # runs on the libvirt event loop thread

    def write(self, data: bytes) -> None:
        if self._closed:
            raise EOFError("terminal is closed")
        view = memoryview(data)
        deadline = time.monotonic() + 10.0
        while view:
            try:
                sent = self._stream.send(bytes(view))
            except libvirt.libvirtError as exc:
                raise EOFError(f"console lost: {exc.get_error_message()}") from exc
            if sent == -2:  # the stream's buffer is full
                if time.monotonic() > deadline:
                    raise EOFError("console is not draining")
                time.sleep(0.01)
                continue
            view = view[sent:]

    def read(self, timeout_s: float = 0.1) -> bytes:
        if self._closed:
            raise EOFError("terminal is closed")
        deadline = time.monotonic() + timeout_s
        while True:
            self._readable.clear()  # before recv: an event after it must wake the wait
            try:
                data = self._stream.recv(65536)
            except libvirt.libvirtError as exc:
                raise EOFError(f"console lost: {exc.get_error_message()}") from exc
            if data == -2:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return b""
                self._readable.wait(remaining)
                continue
            if not data:
                raise EOFError("console closed")
            return bytes(data)

    def resize(self, rows: int, cols: int) -> None:
        # A serial console has no window size to set: a 16550 UART carries bytes, not
        # TIOCSWINSZ. Full-screen programs in the guest can be told with `stty rows cols`.
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(libvirt.libvirtError):
            self._stream.eventRemoveCallback()
        with contextlib.suppress(libvirt.libvirtError):
            self._stream.abort()


# --- driver ------------------------------------------------------------------------------


class LibvirtDriver:
    name = "libvirt"

    def __init__(
        self,
        host: str = "",
        *,
        uri: str | None = None,
        image: GuestImage | None = None,
        domain_type: str | None = None,
        resolve_pci: PciResolver | None = None,
        console_log_dir: Path | None = None,
        network_name: str = "default",
        storage_dir: Path | None = None,
    ) -> None:
        if _LIBVIRT_MISSING is not None:
            raise DriverUnavailable(
                "libvirt",
                f"libvirt-python is not installed ({_LIBVIRT_MISSING})",
                "make install-libvirt (it builds against the libvirt headers: "
                f"{install_command('libvirt-dev pkg-config')})",
            )
        self.host = host
        self.uri = uri or os.environ.get("LIBVIRT_URI") or DEFAULT_URI
        self.image = image or GuestImage.from_env()
        self.domain_type = domain_type or configured_domain_type()
        self.resolve_pci = resolve_pci
        if console_log_dir is None and self.uri.endswith("/system"):
            # virtlogd writes it; qemu:///system keeps its logs here.
            console_log_dir = Path("/var/log/libvirt/qemu")
        self.console_log_dir = console_log_dir
        self.network_name = network_name
        self.storage_dir = storage_root() if storage_dir is None else storage_dir
        self._conn: Any = None
        self._conn_lock = threading.Lock()
        # allocation id -> (bytes of its console rotated away, the file's size when last read)
        self._console_bases: dict[str, tuple[int, int]] = {}

    @property
    def conn(self) -> Any:
        # Opened on first use so that building a driver never needs a running libvirtd.
        with self._conn_lock:
            if self._conn is None or not self._conn.isAlive():
                _ensure_event_loop()
                libvirt.registerErrorHandler(_quiet, None)
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    raise DriverError(
                        f"cannot reach libvirt at {self.uri}: {exc.get_error_message()}"
                    ) from exc
            return self._conn

    def console_log(self, allocation_key: str) -> Path | None:
        """Where libvirt copies the guest's console output (None: not logged)."""
        if self.console_log_dir is None:
            return None
        return self.console_log_dir / f"{domain_name(allocation_key)}.console.log"

    def _lookup(self, handle: SandboxHandle) -> Any | None:
        for how, key in (
            (self.conn.lookupByUUIDString, handle.ref),
            (self.conn.lookupByName, domain_name(handle.allocation_key)),
        ):
            try:
                return how(key)
            except libvirt.libvirtError as exc:
                if not _missing(exc):
                    raise
        return None

    def _handle(self, dom: Any, allocation_key: str, sandbox_id: int) -> SandboxHandle:
        return SandboxHandle(
            driver=self.name, allocation_key=allocation_key, sandbox_id=sandbox_id, ref=dom.UUIDString()
        )

    def _metadata(self, dom: Any) -> tuple[dict[str, str], int | None]:
        try:
            xml = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, 0)
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN_METADATA:
                return {}, None
            raise
        return labels_from_metadata(str(xml))

    def prepare(self, spec: SandboxSpec, report: Callable[[str], None]) -> None:
        """Nothing to fetch: a VM boots the guest image built on the host (scripts/build-vm-image.sh)."""

    def launch(self, spec: SandboxSpec) -> SandboxHandle:
        action = f"launch sandbox {spec.allocation_key} as a VM"
        if spec.real_gpu and spec.device_uuids:
            # Refused before anything is defined: a domain with a hostdev would hang in the
            # unbind or boot a guest that cannot use the GPU (docs/gpu-hosts.md).
            raise DriverError(f"{action}: {GPU_PASSTHROUGH_UNSUPPORTED}")
        name = domain_name(spec.allocation_key)
        log_path = self.console_log(spec.allocation_key)
        with _libvirt_errors(action):
            try:
                dom = self.conn.lookupByName(name)
            except libvirt.libvirtError as exc:
                if not _missing(exc):
                    raise
                dom = None
            if dom is not None:
                state, reason = dom.state()
                never_ran = log_path is None or not log_path.exists()
                if (
                    state == libvirt.VIR_DOMAIN_SHUTOFF
                    and reason == libvirt.VIR_DOMAIN_SHUTOFF_UNKNOWN
                    and never_ran
                ):
                    # A previous launch died between define and start: finish it.
                    self._start(dom)
                return self._handle(dom, spec.allocation_key, spec.sandbox_id)
            missing = self.image.missing()
            if missing:
                raise DriverError(f"{action}: guest image {', '.join(missing)} not readable; {BUILD_HINT}")
            bound = storage.resolve(self.storage_dir, spec.mounts, folder=spec.checkpoint_dir)
            xml = domain_xml(
                spec,
                bound=bound,
                image=self.image,
                domain_type=self.domain_type,
                resolve_pci=self.resolve_pci,
                console_log=log_path,
                network_name=self.network_name,
                launched_ms=int(time.time() * 1000),
            )
            # Same name and UUID on every launch of this allocation: a concurrent define
            # redefines the same domain, and the loser's start finds it running.
            dom = self.conn.defineXML(xml)
            try:
                self._start(dom)
            except libvirt.libvirtError as exc:
                # A domain that cannot start (no image access, no KVM) must not be found by
                # the next launch as if it were the sandbox.
                with contextlib.suppress(libvirt.libvirtError):
                    dom.undefine()
                if self.domain_type == "kvm" and "kvm" in (exc.get_error_message() or "").lower():
                    raise DriverError(
                        f"{action}: QEMU could not run a KVM guest on this host "
                        f"({exc.get_error_message()}); set LIBVIRT_DOMAIN_TYPE=qemu to use TCG"
                    ) from exc
                raise
            log.info("launched sandbox %s as %s domain %s", spec.allocation_key, self.domain_type, name)
            return self._handle(dom, spec.allocation_key, spec.sandbox_id)

    @staticmethod
    def _start(dom: Any) -> None:
        try:
            dom.create()
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_OPERATION_INVALID and dom.isActive():
                return  # a concurrent launch started it first
            raise

    def stop(self, handle: SandboxHandle, grace_s: float = 10.0) -> None:
        with _libvirt_errors(f"stop sandbox {handle.allocation_key}"):
            dom = self._lookup(handle)
            if dom is None:
                return
            try:
                if dom.isActive():
                    self._shutdown(dom, grace_s)
                dom.undefine()
            except libvirt.libvirtError as exc:
                if not _missing(exc):  # undefined concurrently: stopping is idempotent
                    raise
        log_path = self.console_log(handle.allocation_key)
        if log_path is not None:
            with contextlib.suppress(OSError):
                log_path.unlink()
        with self._conn_lock:
            self._console_bases.pop(handle.allocation_key, None)

    def warn(self, handle: SandboxHandle) -> str:
        """The guest's ACPI power button: a VM's SIGTERM (its init shuts down cleanly)."""
        with _libvirt_errors(f"warn sandbox {handle.allocation_key}"):
            dom = self._lookup(handle)
            if dom is None or not dom.isActive():
                return "the VM is no longer running"
            try:
                dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
            except libvirt.libvirtError as exc:
                if _code(exc) != libvirt.VIR_ERR_OPERATION_INVALID:  # powered off meanwhile
                    raise
                return "the VM is no longer running"
        return "ACPI power button pressed"

    def read_output(self, handle: SandboxHandle, offset: int, limit: int) -> OutputChunk:
        """The guest's serial console (the command's output, after the guest's own boot
        lines) from ``offset`` on. virtlogd writes and rotates the file (its ``max_size`` and
        ``max_backups`` bound it on disk); a rotation starts the file afresh, and what went
        before is counted, not read again."""
        log_path = self.console_log(handle.allocation_key)
        try:
            with open(log_path or "", "rb") as console:
                size = os.fstat(console.fileno()).st_size
                with self._conn_lock:
                    base, seen = self._console_bases.get(handle.allocation_key, (0, 0))
                    if size < seen:  # rotated under us
                        base += seen
                    self._console_bases[handle.allocation_key] = (base, size)
                begin = max(offset, base)
                console.seek(begin - base)
                data = console.read(limit)
        except OSError:
            return OutputChunk(start=offset, data=b"", total=offset)
        return OutputChunk(start=begin, data=data, total=base + size)

    @staticmethod
    def _shutdown(dom: Any, grace_s: float) -> None:
        """ACPI power button, up to ``grace_s`` for the guest to power off, then destroy."""
        try:
            dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
        except libvirt.libvirtError as exc:
            if _code(exc) != libvirt.VIR_ERR_OPERATION_INVALID:  # already off
                raise
        deadline = time.monotonic() + max(0.0, grace_s)
        while dom.isActive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if dom.isActive():
            try:
                dom.destroy()
            except libvirt.libvirtError as exc:
                if _code(exc) != libvirt.VIR_ERR_OPERATION_INVALID:  # powered off meanwhile
                    raise

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        with _libvirt_errors(f"inspect sandbox {handle.allocation_key}"):
            dom = self._lookup(handle)
            if dom is None:
                return SandboxStatus(state="missing")
            try:
                state, _reason = dom.state()
                _labels, launched = self._metadata(dom)
            except libvirt.libvirtError as exc:
                if _missing(exc):
                    return SandboxStatus(state="missing")
                raise
        if state in _LIVE_STATES:
            return SandboxStatus(state="running", started_at_ms=launched)
        code = _exit_code(self.console_log(handle.allocation_key))
        return SandboxStatus(state="exited", exit_code=code, started_at_ms=launched)

    def list_owned(self) -> list[SandboxHandle]:
        handles = []
        with _libvirt_errors("list sandboxes"):
            for dom in self.conn.listAllDomains(0):
                try:
                    if not dom.name().startswith("gpushare-"):
                        continue
                    labels, _ = self._metadata(dom)
                    uuid_str = dom.UUIDString()
                except libvirt.libvirtError as exc:
                    if _missing(exc):
                        continue  # undefined while we listed
                    raise
                if ALLOCATION_LABEL not in labels:
                    continue
                if self.host and labels.get(f"{LABEL_PREFIX}.host") != self.host:
                    continue
                try:
                    sandbox_id = int(labels.get(f"{LABEL_PREFIX}.sandbox", "0"))
                except ValueError:
                    log.warning("domain %s has a malformed sandbox label; ignored", dom.name())
                    continue
                handles.append(
                    SandboxHandle(
                        driver=self.name,
                        allocation_key=labels[ALLOCATION_LABEL],
                        sandbox_id=sandbox_id,
                        ref=uuid_str,
                    )
                )
        return handles

    def open_app(self, handle: SandboxHandle) -> ConsoleTerminal:
        raise DriverError(
            f"sandbox {handle.allocation_key}: a VM's web app cannot be reached through the portal yet"
        )

    def open_ssh(self, handle: SandboxHandle, authorized_keys: list[str]) -> ConsoleTerminal:
        raise DriverError(f"sandbox {handle.allocation_key}: a VM has its console, not SSH via the portal")

    def exec_terminal(self, handle: SandboxHandle) -> ConsoleTerminal:
        action = f"open a terminal in sandbox {handle.allocation_key}"
        with _libvirt_errors(action):
            dom = self._lookup(handle)
            if dom is None:
                raise DriverError(f"sandbox {handle.allocation_key} has no domain")
            if not dom.isActive():
                raise DriverError(f"sandbox {handle.allocation_key} is shut off, not running")
            stream = self.conn.newStream(libvirt.VIR_STREAM_NONBLOCK)
            # FORCE: a new terminal takes the console over from an older, forgotten one.
            dom.openConsole(None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
            return ConsoleTerminal(stream)


def libvirt_available(uri: str | None = None) -> bool:
    """True when libvirt at ``uri`` (else LIBVIRT_URI, else qemu:///system) answers."""
    if _LIBVIRT_MISSING is not None:
        return False
    libvirt.registerErrorHandler(_quiet, None)
    try:
        conn = libvirt.open(uri or os.environ.get("LIBVIRT_URI") or DEFAULT_URI)
    except libvirt.libvirtError:
        return False
    try:
        return bool(conn.isAlive())
    except libvirt.libvirtError:
        return False
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()
