"""A process sandbox sees only its own GPUs under /proc/driver/nvidia/gpus (review 3, #8).

The driver lists every GPU of the host there and a fresh procfs shows them all;
libnvidia-container gives a container only its own GPUs' entries. No NVIDIA driver is here:
the host's /proc/driver/nvidia is a fake tree (three GPUs, minors 0, 3 and 5), and the mask
is also run for real with bwrap over that tree.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.engines import require_engine
from tests.workers.test_process_driver import make_spec, options_of
from workers.drivers.gpu_nodes import GpuNodes
from workers.drivers.process import ProcessDriver, _as_sandbox_uid, bwrap_available
from workers.gpu.nvml_session import DeviceIds

BUS_OF_MINOR = {0: "0000:18:00.0", 3: "0000:9a:00.0", 5: "0000:ba:00.0"}


@pytest.fixture
def three_gpu_host() -> Iterator[GpuNodes]:
    """A host of three GPUs, one of them (minor 3) holding a MIG instance, in a folder an
    unprivileged uid can read (bwrap binds as the sandbox's uid)."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-procfs-"))
    root.chmod(0o755)
    proc, dev = root / "proc" / "driver" / "nvidia", root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia3", "nvidia5", "nvidia-caps/nvidia-cap21"):
        (dev / name).write_text(name)
    (dev / "nvidia-caps" / "nvidia-cap22").write_text("cap")
    for minor, bus in BUS_OF_MINOR.items():
        (proc / "gpus" / bus).mkdir(parents=True)
        (proc / "gpus" / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-{minor}\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
    for access, cap in (("gi1/access", 21), ("gi1/ci0/access", 22)):
        path = proc / "capabilities" / "gpu3" / "mig" / access
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"DeviceFileMinor: {cap}\nDeviceFileMode: 292\n")
    ids = {f"GPU-{minor}": DeviceIds(minor) for minor in BUS_OF_MINOR}
    ids["MIG-3"] = DeviceIds(3, gi=1, ci=0)
    yield GpuNodes(proc_root=proc, dev_root=dev, nvml=ids.__getitem__)
    shutil.rmtree(root)


def test_the_mask_keeps_only_the_sandboxs_gpus_and_a_mig_devices_parent(three_gpu_host: GpuNodes) -> None:
    gpus = three_gpu_host.proc_root / "gpus"
    assert three_gpu_host.proc_mask_args(["MIG-3"]) == [
        "--perms", "0555", "--tmpfs", "/proc/driver/nvidia/gpus",
        "--ro-bind", str(gpus / BUS_OF_MINOR[3]), f"/proc/driver/nvidia/gpus/{BUS_OF_MINOR[3]}",
        "--remount-ro", "/proc/driver/nvidia/gpus",
    ]  # fmt: skip
    two = three_gpu_host.proc_mask_args(["GPU-0", "GPU-5"])
    assert [target for _, target in options_of(two, "--ro-bind")] == [
        f"/proc/driver/nvidia/gpus/{BUS_OF_MINOR[0]}",
        f"/proc/driver/nvidia/gpus/{BUS_OF_MINOR[5]}",
    ]
    assert three_gpu_host.proc_mask_args([]) == []


def test_a_host_without_the_drivers_proc_directory_gets_no_mask(three_gpu_host: GpuNodes) -> None:
    """A fresh procfs has nothing to hide there, and bwrap could not make the mount point."""
    shutil.rmtree(three_gpu_host.proc_root / "gpus")
    assert three_gpu_host.proc_mask_args(["GPU-0"]) == []


def test_a_gpu_sandboxs_bwrap_hides_the_other_gpus_after_its_fresh_procfs(
    tmp_path: Path, three_gpu_host: GpuNodes
) -> None:
    driver = ProcessDriver(tmp_path, gpu_nodes=three_gpu_host)
    argv = driver._bwrap_args(make_spec(device_uuids=("GPU-5",), real_gpu=True), 3, 4, 5, 6)
    mask = three_gpu_host.proc_mask_args(["GPU-5"])
    at = next(i for i in range(len(argv)) if argv[i : i + len(mask)] == mask)
    assert at > argv.index("--proc")
    # A CPU-only or simulated sandbox binds no GPU and needs no mask.
    assert "/proc/driver/nvidia/gpus" not in driver._bwrap_args(make_spec(), 3, 4, 5, 6)


def test_bwrap_over_a_fake_driver_tree_shows_only_the_sandboxs_gpu(three_gpu_host: GpuNodes) -> None:
    """The same arguments, run by bwrap as a sandbox's unprivileged uid over the fake tree
    (at its own path: no driver's /proc exists here)."""
    require_engine(bwrap_available(), "bwrap")
    root = str(three_gpu_host.proc_root)
    mask = three_gpu_host.proc_mask_args(["MIG-3"], sandbox_root=root)
    script = f"ls {root}/gpus; cat {root}/gpus/*/information; touch {root}/gpus/x 2>/dev/null || echo ro"
    bwrap = ["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--proc", "/proc"]
    argv = _as_sandbox_uid([*bwrap, *mask, "--", "sh", "-c", script])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == BUS_OF_MINOR[3]
    assert "Device Minor: \t 3" in done.stdout and "GPU-0" not in done.stdout and "GPU-5" not in done.stdout
    assert lines[-1] == "ro"
    # The host's tree is untouched.
    on_host = (three_gpu_host.proc_root / "gpus").iterdir()
    assert sorted(p.name for p in on_host) == sorted(BUS_OF_MINOR.values())
