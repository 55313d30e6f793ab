"""The web terminal starts its shell in the sandbox's home, a path the tenant can replace: a
process sandbox can move /home aside and make ``/home/sandbox`` a symlink. The agent's helper
(root until it becomes the sandbox's user) must not enter it as root, or the shell would sit
in a folder its user could never enter. A container's root is read-only: nothing to move."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.test_driver_storage import driver_for, make_spec, output_of
from wire.storage import StorageMount
from workers.drivers.base import SandboxDriver

# Root's own folder in the sandbox's view (a dataset the sandbox's uid may not enter), with a
# file anyone may read once inside.
PRIVATE = StorageMount("private", "datasets/private", "/datasets/private", True, 0)
PLANT = (
    "(mv /home /home.old && mkdir /home && ln -s /datasets/private /home/sandbox) 2>&1;"
    " echo READY; exec sleep 300"
)


@pytest.fixture(
    params=[
        pytest.param("process", marks=pytest.mark.bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
def driver(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SandboxDriver, str, str]]:
    storage = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    storage.chmod(0o755)
    (storage / "datasets" / "private").mkdir(parents=True)
    (storage / "datasets").chmod(0o755)
    (storage / "datasets" / "private").chmod(0o700)
    (storage / "datasets" / "private" / "note").write_text("root's note\n")
    (storage / "datasets" / "private" / "note").chmod(0o644)
    host = f"test-{uuid.uuid4().hex[:8]}"
    driver, image = driver_for(request.param, host, storage, tmp_path / "state")
    yield driver, image, host
    for handle in driver.list_owned():
        driver.stop(handle, grace_s=0)
    shutil.rmtree(storage, ignore_errors=True)


def test_a_home_replaced_by_a_symlink_is_not_entered_as_root(driver: tuple[SandboxDriver, str, str]) -> None:
    sandboxes, image, host = driver
    spec = make_spec(host, 801, PLANT, image, mounts=(PRIVATE,))
    handle = sandboxes.launch(spec)
    output_of(sandboxes, handle, "READY")
    terminal = sandboxes.exec_terminal(handle)
    try:
        terminal.write(b"pwd; cat note 2>&1; echo DONE-$((40+2))\n")  # the sum: not the echo
        seen = b""
        deadline = time.monotonic() + 30
        while b"DONE-42" not in seen and time.monotonic() < deadline:
            seen += terminal.read(0.5)  # EOFError if the shell died: the test fails
    finally:
        terminal.close()
    assert b"DONE-42" in seen, seen
    # Entered as root, the shell sat in root's folder (the kernel still checks search
    # permission on it for every name, so the note stayed unread): it is not entered at all.
    assert b"/datasets/private" not in seen and b"root's note" not in seen, seen
