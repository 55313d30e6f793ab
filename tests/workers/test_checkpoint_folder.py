"""A sandbox's checkpoint folder (the resume contract): made by the agent in one of its
read-write volumes before it starts, the same folder on its next attempt, and made without
following anything a tenant planted on the way (the volume is the tenant's to write)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.workers.test_driver_storage import (  # noqa: F401 - fixtures
    GID,
    READY,
    VOLUME,
    home,
    make,
    make_spec,
    output_of,
    storage_dir,
)
from wire import uids
from wire.spec import SandboxSpec
from wire.storage import StorageMount
from workers.drivers import storage
from workers.drivers.base import DriverError

FOLDER = "/home/sandbox/.gpushare/checkpoints/sandbox-701"
# A batch that resumes from its last step: what the contract is for.
RESUMING = (
    'd=$GPUSHARE_CHECKPOINT_DIR; n=$(cat "$d/step" 2>/dev/null || echo 0); '
    'echo "attempt $GPUSHARE_ATTEMPT from step $n"; n=$((n+1)); echo $n > "$d/step.new" && '
    f'mv "$d/step.new" "$d/step" && echo {READY}; exec sleep 300'
)


def test_a_sandbox_finds_its_folder_made_and_finds_it_again(make: tuple, storage_dir: Path) -> None:  # noqa: F811
    driver, spec = make
    for attempt, step in ((1, 0), (2, 1)):
        env = {"GPUSHARE_ATTEMPT": str(attempt), "GPUSHARE_CHECKPOINT_DIR": FOLDER}
        handle = driver.launch(spec(701, RESUMING, env=env))
        out = output_of(driver, handle, READY)
        assert f"attempt {attempt} from step {step}" in out, out
        driver.stop(handle, grace_s=0)
    made = storage_dir / "homes" / str(VOLUME) / ".gpushare" / "checkpoints" / "sandbox-701"
    assert (made / "step").read_text() == "2\n"
    if os.geteuid() == 0:
        info = made.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, GID, 0o2770)


@pytest.mark.parametrize("planted", [".gpushare", ".gpushare/checkpoints"])
def test_a_link_planted_on_the_way_is_refused_not_followed(
    storage_dir: Path,  # noqa: F811
    tmp_path: Path,
    planted: str,
) -> None:
    volume = storage_dir / "homes" / str(VOLUME)
    storage.resolve(storage_dir, (home(),))  # the volume, as a first launch made it
    elsewhere = tmp_path / "host-folder"
    elsewhere.mkdir()
    link = volume / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    with pytest.raises(DriverError, match="is not a plain folder"):
        storage.resolve(storage_dir, (home(),), folder=FOLDER)
    assert list(elsewhere.iterdir()) == []  # nothing made through the link


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root agent can tell its own folders")
@pytest.mark.parametrize("kind", ["link", "folder of a sandbox's uid"])
def test_a_checkpoint_folder_made_in_its_place_by_someone_else_is_moved_aside(
    storage_dir: Path,  # noqa: F811
    tmp_path: Path,
    kind: str,
) -> None:
    """A sandbox id is easy to guess: another member could make the folder first and fill it
    with a "checkpoint". The agent moves such a folder aside and makes its own."""
    volume = storage_dir / "homes" / str(VOLUME)
    storage.resolve(storage_dir, (home(),))
    made = volume / ".gpushare" / "checkpoints" / "sandbox-701"
    made.parent.mkdir(parents=True)
    elsewhere = tmp_path / "host-folder"
    elsewhere.mkdir()
    if kind == "link":
        made.symlink_to(elsewhere)
    else:
        made.mkdir()
        (made / "state.pt").write_text("not yours")
        os.chown(made, uids.sandbox_uid(9), GID)
    storage.resolve(storage_dir, (home(),), folder=FOLDER)
    assert made.is_dir() and not made.is_symlink() and list(made.iterdir()) == []
    assert made.stat().st_uid == 0
    [_aside] = [p for p in made.parent.iterdir() if p.name.startswith("sandbox-701.not-made-by-gpushare-")]
    assert list(elsewhere.iterdir()) == []
    # The agent's own folder, found again at the next attempt, is kept with what it holds.
    (made / "step").write_text("3")
    storage.resolve(storage_dir, (home(),), folder=FOLDER)
    assert (made / "step").read_text() == "3"


@pytest.mark.parametrize(
    "folder",
    [
        "/datasets/mnist/ckpt",
        "/elsewhere/ckpt",
        "/home/sandbox/../etc/ckpt",
        "relative/ckpt",
        "/home/sandbox",
    ],
)
def test_a_folder_outside_its_writable_storage_is_refused(storage_dir: Path, folder: str) -> None:  # noqa: F811
    dataset = StorageMount("mnist", "datasets/mnist", "/datasets/mnist", True, 0)
    with pytest.raises(DriverError, match="folder"):
        storage.resolve(storage_dir, (home(), dataset), folder=folder)


def test_the_folder_travels_as_the_sandboxs_variable_so_older_agents_still_read_the_message() -> None:
    """An agent not yet upgraded refuses a launch message with a field it does not know: the
    folder is no new field, only the variable the sandbox is told (such an agent makes none)."""
    spec = make_spec("h", 1, "true", env={"GPUSHARE_CHECKPOINT_DIR": FOLDER})
    message = spec.to_json()
    assert "checkpoint_dir" not in message and SandboxSpec.from_json(message).checkpoint_dir == FOLDER
