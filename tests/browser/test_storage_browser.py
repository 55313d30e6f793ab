"""Persistent storage in Chromium against the real platform (web server, control worker, an
agent with the process driver): the request form shows the tier's storage, a batch writes to
its owner's home and the project's folder, the owner's next sandbox finds the files, a
colleague finds the project's folder but not the owner's home, and the project page shows
the usage the agent measured. Screenshots go to docs/screenshots/storage-*.png."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Storage
from portal.sandboxes.models import Sandbox
from tests.browser.pages import request_batch, shot, sign_in
from tests.e2e.platform import running_platform, wait_for
from tests.workers.engines import require_engine
from workers.drivers.process import bwrap_available

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.slow,
              pytest.mark.django_db(transaction=True)]  # fmt: skip


@pytest.fixture
def storage_root() -> Iterator[Path]:
    # Reachable by the sandboxes' uids, as a real STORAGE_ROOT is (not under pytest's 0700 tmp).
    root = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    sample = root / "datasets" / "sample"
    sample.mkdir(parents=True)
    (sample / "README").write_text("digits, 60,000 of them\n")
    for folder in (root, sample.parent, sample):
        folder.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def with_storage(catalog: Any) -> None:
    home = {"kind": "home", "directory": "homes", "mount_path": "/home/sandbox", "limit_gib": 10}
    folder = {"kind": "project", "directory": "projects", "mount_path": "/project", "limit_gib": 50}
    data = {"kind": "dataset", "directory": "datasets/sample", "mount_path": "/data/sample"}
    named = (("Home", home), ("Project folder", folder), ("Sample", data))
    catalog["dedicated"].storages.set([Storage.objects.create(name=n, **v) for n, v in named])


def run_batch(page: Any, base: str, who: str, command: str) -> Sandbox:
    """``who`` asks for a batch on a whole GPU as a process sandbox; returns it once ended."""
    page.context.clear_cookies()  # signed out: whoever was signed in before
    request_batch(page, base, command, who)
    sandbox_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    wait_for(lambda: Sandbox.objects.get(pk=sandbox_id).state == "stopped", 120, f"{who}'s batch to end")
    return Sandbox.objects.get(pk=sandbox_id)


def output(page: Any, text: str) -> str:
    """The ended run's output as its page renders it, reloaded until ``text`` is there: the
    last lines travel in their own message, which the control worker may take after the
    stop's (its threads run them side by side), so the page may first show the run ended
    and its output a moment later."""
    deadline = time.monotonic() + 30
    while True:
        page.reload()
        shown = page.locator("pre.output", has_text=text)
        if shown.count() or time.monotonic() > deadline:
            return str(shown.inner_text(timeout=5_000))
        time.sleep(0.5)


def test_files_outlive_the_sandbox_and_stay_their_owners(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any, storage_root: Path
) -> None:
    require_engine(bwrap_available(), "bubblewrap")
    with_storage(catalog)
    page = browser_page
    extra = {"STORAGE_ROOT": str(storage_root)}
    platform = running_platform(tmp_path, web=True, sim_gpus="A100-80GB:1", driver="process", extra_env=extra)
    with platform as p:
        base = f"http://127.0.0.1:{p.port}"
        write = (
            "sh -c 'echo epoch 3 > $HOME/checkpoint.txt; head -c 3145728 /dev/zero > /project/features.bin; "
            "cat /data/sample/README; touch /data/sample/x || echo dataset is read-only'"
        )
        sign_in(page, base, "olivia", "/sandboxes/new/")
        page.select_option("select[name=project]", label="Vision")
        page.select_option("select[name=tier]", label="Dedicated")
        page.select_option("select[name=image]", label="busybox")
        page.locator(".storage-lines", has_text="read-only dataset").wait_for(timeout=10_000)
        shot(page, "storage-request-form")

        first = run_batch(page, base, "olivia", write)
        assert "dataset is read-only" in output(page, "digits")
        # The owner's next sandbox, a new uid on the host, finds the file it wrote.
        run_batch(page, base, "olivia", "sh -c 'cat $HOME/checkpoint.txt; ls -l /project'")
        found = output(page, "epoch 3")
        assert "features.bin" in found
        # A colleague: the project's folder, but a home of their own.
        peek = "sh -c 'ls /project; cat $HOME/checkpoint.txt || echo no such home file'"
        run_batch(page, base, "mark", peek)
        theirs = output(page, "features.bin")
        assert "no such home file" in theirs and "epoch 3" not in theirs

        # The usage the agent measured after the stops, on the project page.
        page.context.clear_cookies()
        sign_in(page, base, "olivia", "/projects/vision/")
        measured = first.project.storagevolume_set.filter(used_bytes__gte=3 << 20)
        wait_for(measured.exists, 30, "the project folder's usage")
        page.reload()
        assert "3.0 MiB of 50 GiB used" in page.locator("#storage").inner_text()
        shot(page, "storage-project-page")
    homes = {f.name for f in (storage_root / "homes").iterdir()}
    assert homes == {str(people["owner"].pk), str(people["member"].pk)}  # one home each, by id
