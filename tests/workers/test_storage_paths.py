"""Storage volumes are their tenants' to write: the agent resolves, prepares and measures them
without following anything planted in them, and binds no path a tenant could swap for a
link before Docker, libvirt or bubblewrap mounts it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.workers.test_driver_storage import (  # noqa: F401 - fixtures
    GID,
    READY,
    VOLUME,
    home,
    make,
    output_of,
    storage_dir,
)
from wire.storage import StorageMount
from workers.drivers import storage, tenant_paths
from workers.drivers.base import DriverError

MIB = 1 << 20


def test_a_volume_below_another_volume_is_refused(make: tuple, storage_dir: Path) -> None:  # noqa: F811
    """``homes/7`` is its tenant's (2770, the volume's group): a project folder inside it could
    be swapped for a symlink to / between the agent's checks and the engine's bind."""
    driver, spec = make
    nested = StorageMount("project", f"homes/{VOLUME}/proj", "/project", False, GID + 1, VOLUME + 1)
    with pytest.raises(DriverError, match="only the host writes"):
        driver.launch(spec(601, "sleep 300", mounts=(home(), nested)))
    assert driver.list_owned() == []


def test_a_dataset_below_a_folder_others_may_write_is_refused(make: tuple, storage_dir: Path) -> None:  # noqa: F811
    driver, spec = make
    (storage_dir / "datasets").chmod(0o775)  # an admin group's, or anyone's: not the host's alone
    dataset = StorageMount("mnist", "datasets/mnist", "/datasets/mnist", True, 0)
    with pytest.raises(DriverError, match="only the host writes"):
        driver.launch(spec(602, "sleep 300", mounts=(dataset,)))
    assert driver.list_owned() == []


def test_what_a_tenant_plants_in_its_volume_is_measured_not_followed(
    make: tuple,  # noqa: F811
    storage_dir: Path,  # noqa: F811
) -> None:
    """Links to the host's /usr and, through /proc, to another process's root, and a FIFO: the
    meter counts the link itself, opens no FIFO, and finishes."""
    driver, spec = make
    plant = (
        "head -c 300000 /dev/zero > $HOME/data && ln -s /usr $HOME/usr && ln -s /proc/1/root $HOME/other "
        f"&& mkfifo $HOME/fifo && mkdir -p $HOME/a/b && ln -s / $HOME/a/b/root; echo {READY}; exec sleep 300"
    )
    handle = driver.launch(spec(603, plant))
    output_of(driver, handle, READY)
    found = storage.measure(storage_dir, f"homes/{VOLUME}", deadline_s=60)
    assert found is not None
    used, complete = found
    assert complete and 300_000 <= used < 2 * MIB  # /usr alone is hundreds of MiB


def test_a_folder_swapped_for_a_link_while_it_is_measured_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant's swap lands between the walk's look at ``sub`` (a folder) and its going
    in, whichever way the walk goes in: by the path (os.scandir) or through a descriptor."""
    root = tmp_path / "storage"
    volume = root / "homes" / "7"
    (volume / "sub").mkdir(parents=True)
    (volume / "sub" / "small").write_bytes(b"x" * 4096)
    host = tmp_path / "host"
    host.mkdir()
    (host / "big").write_bytes(os.urandom(4 * MIB))  # allocated, not a hole
    swapped: list[bool] = []

    def swap() -> None:
        if not swapped:
            swapped.append(True)
            (volume / "sub").rename(volume / "sub.old")
            (volume / "sub").symlink_to(host)

    def before(call: Callable[..., Any], entering: Callable[..., bool]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if entering(*args):
                swap()
            return call(*args, **kwargs)

        return hooked

    monkeypatch.setattr(os, "scandir", before(os.scandir, lambda path=None: str(path).endswith("/sub")))
    monkeypatch.setattr(
        tenant_paths, "open_beneath", before(tenant_paths.open_beneath, lambda fd, name, *_: name == "sub")
    )
    found = storage.measure(root, "homes/7", deadline_s=60)
    assert swapped and found is not None
    used, _ = found
    assert used < MIB, "the walk followed the link to the host's folder"
