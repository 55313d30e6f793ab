"""Defence in depth at the drivers: whatever spec the platform (or a forged launch message)
hands an agent, the arguments each driver builds never grant host privileges.

No engine is needed: ``container_kwargs`` (Docker), ``ProcessDriver._bwrap_args`` (bwrap)
and ``domain_xml`` (libvirt) are pure builders, checked here over hypothesis-made specs.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import docker.types
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import uids
from wire.spec import MpsShare, SandboxSpec
from workers.drivers.base import DriverError, checked_pipe_dir
from workers.drivers.docker import container_kwargs, sandbox_user
from workers.drivers.gpu_nodes import GpuNodes, Node
from workers.drivers.libvirt import GuestImage, domain_xml
from workers.drivers.process import ProcessDriver

# Text as the platform makes it: no control characters or surrogates (the form and the API
# refuse them), otherwise anything, shell and XML metacharacters included.
TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40)
HOSTILE = st.sampled_from(
    ["--privileged", "--bind", "/", "$(reboot)", "; rm -rf /", "<x/>", "&amp;", "'\"", "../..", "-v/:/h"]
)
WORDS = st.one_of(TEXT, HOSTILE)
SAFE_PIPES = st.sampled_from(["/run/gpushare/mps/GPU-a/pipe", "/var/lib/gpushare/mps/GPU-b/pipe"])
BAD_PIPES = st.sampled_from(
    ["/", "/home", "/etc", "/var/run/docker.sock", "/run", "/var", "relative/pipe", "/tmp/../etc",
     "/usr/lib", "/dev/shm", "/proc/1/root", "/run/docker.sock", ""]
)  # fmt: skip
DEVICES = st.one_of(
    st.from_regex(r"(GPU|MIG)-[0-9a-f]{8}", fullmatch=True), WORDS.filter(lambda s: not s.startswith("-"))
)

specs = st.builds(
    SandboxSpec,
    allocation_key=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", fullmatch=True),
    sandbox_id=st.integers(0, 2**63 - 1),
    host=WORDS,
    project=WORDS,
    owner=WORDS,
    image=st.one_of(WORDS, st.sampled_from(["evil.example/busybox:latest", "busybox@sha256:" + "0" * 64])),
    command=st.lists(WORDS, max_size=5).map(tuple),
    device_uuids=st.lists(DEVICES, max_size=4).map(tuple),
    real_gpu=st.booleans(),
    cpu_limit=st.floats(0.01, 64),
    memory_limit_mib=st.integers(16, 1 << 20),
    pids_limit=st.integers(1, 1 << 16),
    shm_size_mib=st.integers(0, 1 << 20),
    network=st.booleans(),
    mps=st.none() | st.builds(MpsShare, st.one_of(SAFE_PIPES, BAD_PIPES), st.integers(), st.integers()),
    env=st.dictionaries(WORDS.filter(bool), WORDS, max_size=4),
    isolation=st.sampled_from(["", "container", "process", "vm", "host"]),
    tier=WORDS,
)


def _pipe_is_safe(spec: SandboxSpec) -> bool:
    try:
        return spec.mps is None or bool(checked_pipe_dir(spec.mps.pipe_dir))
    except DriverError:
        return False


@pytest.mark.parametrize(
    "path", ["/", "/home", "/var/run/docker.sock", "/run", "/var", "/etc/x", "a/b", "/a/../b"]
)
def test_protected_paths_are_no_pipe_dir(path: str) -> None:
    with pytest.raises(DriverError):
        checked_pipe_dir(path)
    assert checked_pipe_dir("/home/dev/gpushare/var/mps/GPU-a/pipe")  # a checkout under a home


# --- Docker ----------------------------------------------------------------------------------

DOCKER_KEYS = {
    "image", "command", "name", "hostname", "labels", "environment", "user", "working_dir", "cap_drop",
    "security_opt", "read_only", "tmpfs", "mem_limit", "memswap_limit", "nano_cpus", "pids_limit", "init",
    "restart_policy", "auto_remove", "network_mode", "device_requests", "mounts", "log_config", "shm_size",
}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(specs)
def test_docker_kwargs_never_grant_host_privileges(spec: SandboxSpec) -> None:
    if not _pipe_is_safe(spec):
        with pytest.raises(DriverError):
            container_kwargs(spec)
        return
    kwargs = container_kwargs(spec)
    # Only keys we know: no privileged, cap_add, devices, volumes, binds, pid/ipc/userns modes.
    assert set(kwargs) <= DOCKER_KEYS, set(kwargs) - DOCKER_KEYS
    assert kwargs["cap_drop"] == ["ALL"] and kwargs["security_opt"] == ["no-new-privileges"]
    uid = sandbox_user(spec)
    assert kwargs["read_only"] is True and kwargs["user"] == f"{uid}:{uid}" and uid >= uids.SANDBOX_UID_BASE
    # No network: "none"; with one: the engine's default (bridge) network, never the host's.
    assert kwargs.get("network_mode") == (None if spec.network else "none")
    requests = kwargs.get("device_requests", [])
    # A CPU-only sandbox (no device UUIDs) asks for no GPU, even on a host with real ones.
    wanted = [list(spec.device_uuids)] if spec.real_gpu and spec.device_uuids else []
    assert [list(r["DeviceIDs"]) for r in requests] == wanted
    mounts = kwargs.get("mounts", [])
    if spec.mps is None:
        assert mounts == []
    else:
        [mount] = mounts
        assert isinstance(mount, docker.types.Mount)
        assert mount["Source"] == mount["Target"] == spec.mps.pipe_dir and mount["Type"] == "bind"
    assert set(kwargs["tmpfs"]) == {"/tmp", "/home/sandbox"}  # the container's own tmpfs


# --- bubblewrap ------------------------------------------------------------------------------

_ARITY = {
    "--unshare-all": 0, "--unshare-user": 0, "--disable-userns": 0, "--seccomp": 1,
    "--die-with-parent": 0, "--new-session": 0, "--clearenv": 0,
    "--uid": 1, "--gid": 1, "--hostname": 1, "--tmpfs": 1, "--proc": 1, "--dev": 1, "--size": 1,
    "--perms": 1, "--chdir": 1, "--json-status-fd": 1,
    "--ro-bind": 2, "--ro-bind-try": 2, "--bind": 2, "--dev-bind": 2, "--symlink": 2, "--setenv": 2,
    "--ro-bind-data": 2, "--remount-ro": 1,
}  # fmt: skip
_RO_SOURCES = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys"}


def bwrap_options(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(option, arguments) up to ``--``, and the command after it; an option this test does
    not know fails it. Parsed by arity: an option's value may itself be "--"."""
    assert argv[0] == "bwrap"
    options, i = [], 1
    while argv[i] != "--":
        option = argv[i]
        assert option in _ARITY, f"unexpected bwrap option {option}"
        options.append((option, argv[i + 1 : i + 1 + _ARITY[option]]))
        i += 1 + _ARITY[option]
    return options, argv[i + 1 :]


class OneNodePerDevice(GpuNodes):
    """A host where every device resolves (the real resolver checks the nodes exist)."""

    def nodes(self, uuids: Iterable[str]) -> list[Node]:
        return [Node(Path(f"/dev/nvidia{i}"), f"/dev/nvidia{i}") for i, _ in enumerate(uuids)]


@settings(max_examples=300, deadline=None)
@given(specs)
def test_bwrap_never_shares_the_host(spec: SandboxSpec) -> None:
    driver = ProcessDriver(Path("/nonexistent/state"), gpu_nodes=OneNodePerDevice())
    if spec.network or not _pipe_is_safe(spec):
        with pytest.raises(DriverError):
            driver._bwrap_args(spec, 3, 4, 5, 6)
        return
    argv = driver._bwrap_args(spec, 3, 4, 5, 6)
    options, command = bwrap_options(argv)
    flags = [name for name, _ in options]
    assert "--unshare-all" in flags and "--clearenv" in flags  # net, pid, ipc, uts, user, cgroup
    # No user namespace of its own inside, and the seccomp filter from the driver's fd.
    assert "--disable-userns" in flags and ("--seccomp", ["6"]) in options
    assert command == list(spec.command)
    for name, args in options:
        if name in ("--bind", "--dev-bind"):  # read-write
            source = args[0]
            allowed = source.startswith("/dev/nvidia") or (spec.mps and source == spec.mps.pipe_dir)
            assert allowed, f"read-write bind of {source}"
        if name in ("--ro-bind", "--ro-bind-try"):
            # (on a host with the NVIDIA driver: the sandbox's own GPUs' /proc entries)
            own_gpu = args[0].startswith("/proc/driver/nvidia/gpus/") and spec.device_uuids
            assert args[0] in _RO_SOURCES or args[0].startswith("/etc/") or own_gpu, args
        if "bind" in name:
            assert args[0] not in ("/", "/home", "/var/run/docker.sock", "/run/docker.sock", "/etc")
        if not spec.device_uuids:  # CPU only: no GPU node at all, never "every node" for none named
            assert not args or not args[0].startswith("/dev/nvidia"), (name, args)


# --- libvirt ---------------------------------------------------------------------------------

IMAGE = GuestImage(kernel=Path("/var/lib/gpushare/vm/vmlinuz"), initrd=Path("/var/lib/gpushare/vm/initrd"))


@settings(max_examples=200, deadline=None)
@given(specs)
def test_libvirt_domains_pass_no_host_filesystem_or_network(spec: SandboxSpec) -> None:
    try:
        xml = domain_xml(spec, image=IMAGE, domain_type="qemu", resolve_pci=lambda uuid: "0000:3b:00.0")
    except DriverError:
        return  # a MIG device or a command too long for the kernel line: refused, not weakened
    root = ET.fromstring(xml)  # noqa: S314 - our own XML
    devices = root.find("devices")
    assert devices is not None
    tags = {child.tag for child in devices}
    assert tags <= {"serial", "console", "interface", "hostdev", "controller", "memballoon"}, tags
    assert root.find(".//filesystem") is None and root.find(".//disk") is None
    assert "commandline" not in xml  # no raw QEMU arguments
    interfaces: list[Any] = devices.findall("interface")
    assert len(interfaces) == (1 if spec.network else 0)
    for iface in interfaces:  # a libvirt virtual network (NAT), never a host bridge or macvtap
        assert iface.get("type") == "network"
    hostdevs = devices.findall("hostdev")
    assert len(hostdevs) == (len(spec.device_uuids) if spec.real_gpu else 0)
    assert all(h.get("type") == "pci" for h in hostdevs)
    assert [e.text for e in root.iter("kernel")] == [str(IMAGE.kernel)]
