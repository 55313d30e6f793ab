"""A notebook through the portal, in Chromium against the real platform (web server, control
worker, two agents with the Docker driver, the locally built JupyterLab image): issue 21's
acceptance, step by step. A user starts a notebook sandbox, opens JupyterLab from its page
on the app's own origin (``<sandbox>-<key>.apps.localhost``, issue 34), writes a file in
their home, stops it, starts another on a different host and finds the file; another user
is refused at the notebook's portal link and at its origin, and has a home of their own; the
sandbox has no network. Screenshot: docs/screenshots/notebook-*.png."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from portal.catalog.models import SandboxImage, Storage
from portal.control.faults import do_drain_gpu
from portal.fleet.models import Gpu
from portal.launcher import AGENT_WORKER_FLAGS
from portal.sandboxes.models import Sandbox
from tests.browser.pages import SHOTS, shot, sign_in
from tests.e2e.platform import running_platform, wait_for
from tests.workers.engines import require_engine
from workers.drivers.docker import docker_available

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow,
              pytest.mark.django_db(transaction=True)]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def storage_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gpushare-storage-", dir="/var/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def notebook_catalog(catalog: Any) -> SandboxImage:
    require_engine(docker_available(), "Docker engine")
    built = subprocess.run(
        [REPO / "scripts" / "build-python-image.sh", "notebook"], capture_output=True, text=True, check=False
    )
    require_engine(built.returncode == 0, f"the notebook image ({built.stderr[-500:]})")
    home = Storage.objects.create(name="Home", kind="home", directory="homes", mount_path="/home/sandbox")
    catalog["dedicated"].storages.set([home])
    return SandboxImage.objects.create(
        name="JupyterLab",
        reference="gpushare/notebook:1",
        command=["/usr/local/bin/gpushare-app"],
        app="JupyterLab",
    )


def start_notebook(page: Any, base: str) -> Sandbox:
    """Olivia asks for an interactive notebook sandbox and waits until it runs."""
    page.goto(f"{base}/sandboxes/new/")
    page.select_option("select[name=project]", label="Vision")
    page.select_option("select[name=tier]", label="Dedicated")
    page.select_option("select[name=image]", label="JupyterLab")
    page.select_option("select[name=isolation]", "container")
    page.click("form.request-form button[type=submit]")
    # The form's own URL (/sandboxes/new/) would match a glob at once, before the submit
    # has navigated: wait for the sandbox's page, by its number.
    page.wait_for_url(re.compile(r".*/sandboxes/\d+/$"))
    sandbox_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    wait_for(
        lambda: Sandbox.objects.get(pk=sandbox_id).state == "running", 120, "the notebook sandbox to run"
    )
    return Sandbox.objects.get(pk=sandbox_id)


def app_origin(sandbox: Sandbox, platform: Any) -> str:
    return f"http://{sandbox.pk}-{sandbox.allocation_key}.apps.localhost:{platform.port}"


def open_lab(page: Any) -> Any:
    """Its page's *Open JupyterLab*, which opens a tab; JupyterLab's file browser in it."""
    page.locator("#open-app").wait_for(timeout=30_000)
    with page.context.expect_page() as opened:
        page.click("#open-app")
    lab = opened.value
    lab.locator(".jp-DirListing").wait_for(timeout=120_000)  # its file browser: it has loaded
    return lab


def contents(lab: Any, name: str, text: str | None = None) -> Any:
    """JupyterLab's contents API from inside its page (its own XSRF cookie): write ``text``
    into ``name`` in the home, or read it."""
    url = f"/api/contents/{name}"
    script = """async ([url, text]) => {
        const xsrf = document.cookie.split('; ').find(c => c.startsWith('_xsrf='))?.split('=')[1] || '';
        const headers = {'X-XSRFToken': xsrf, 'Content-Type': 'application/json'};
        const body = JSON.stringify({type: 'file', format: 'text', content: text});
        const init = text === null ? {} : {method: 'PUT', headers, body};
        const r = await fetch(url + (text === null ? '?content=1' : ''), init);
        return {status: r.status, body: await r.json()};
    }"""
    return lab.evaluate(script, [url, text])


def test_a_notebook_through_the_portal_keeps_its_files_across_hosts(
    people: Any, catalog: Any, tmp_path: Path, browser_page: Any, storage_root: Path
) -> None:
    notebook_catalog(catalog)
    page = browser_page
    extra = {"STORAGE_ROOT": str(storage_root)}
    with running_platform(
        tmp_path, web=True, sim_gpus="A100-80GB:1", driver="docker", extra_env=extra
    ) as platform:
        base = f"http://127.0.0.1:{platform.port}"
        second = f"{platform.host}-b"
        platform.start(
            "agent-b",
            [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", f"host.{second}", "-n",
             f"agent-{second}@%h", "-P", "threads", "-c", "2", *AGENT_WORKER_FLAGS, "--loglevel=INFO"],
            GPUSHARE_ROLE="agent", GPUSHARE_HOST=second, GPUSHARE_SIM_GPUS="A100-80GB:1",
            GPU_BACKEND="simulated", SANDBOX_DRIVER="docker", SAMPLE_INTERVAL_MS="500",
            **platform.agent_credential(second),
        )  # fmt: skip
        wait_for(lambda: Gpu.objects.filter(host__name=second).exists(), 60, "the second host's inventory")

        # Step 1: the notebook runs, and its owner opens JupyterLab through the portal.
        sign_in(page, base, "olivia", "/sandboxes/new/")
        first = start_notebook(page, base)
        lab = open_lab(page)
        assert lab.url.startswith(f"{app_origin(first, platform)}/lab")  # its own origin, not the portal's
        # A kernel, through the app's WebSockets: code runs, and sees no network but loopback.
        lab.locator("#jupyterlab-splash").wait_for(state="detached", timeout=60_000)
        lab.locator('.jp-LauncherCard[data-category="Notebook"]').first.click()
        cell = lab.locator(".jp-Notebook .jp-Cell .cm-content").first
        cell.wait_for(timeout=60_000)
        # Its kernel up and connected (the status bar says so): a cell run before would not be sent.
        lab.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)
        cell.click()
        lab.keyboard.type("import socket; print('kernel says', 6 * 7, [n for _, n in socket.if_nameindex()])")
        lab.keyboard.press("Shift+Enter")
        lab.locator(".jp-OutputArea-output", has_text="kernel says 42 ['lo']").wait_for(timeout=60_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        lab.screenshot(path=str(SHOTS / "notebook-through-portal.png"))  # JupyterLab's page, not ours: no axe

        # Step 2: a file written in the home, through JupyterLab.
        written = contents(lab, "notes.txt", "epoch 3: loss 0.031\n")
        assert written["status"] in (200, 201), written
        # Step 3: the sandbox has no network: its container is on Docker's "none" network.
        container = docker.from_env().containers.get(first.handle["ref"])  # type: ignore[index]
        assert list(container.attrs["NetworkSettings"]["Networks"]) == ["none"]
        lab.close()

        # Step 4: stopped, then another notebook on the other host finds the file.
        # (the page's confirm() is accepted by the browser_page fixture)
        page.click("#stop-button")
        wait_for(
            lambda: Sandbox.objects.get(pk=first.pk).state == "stopped", 60, "the first notebook to stop"
        )
        first_host = Sandbox.objects.get(pk=first.pk).host
        for gpu in Gpu.objects.filter(host=first_host):
            do_drain_gpu(gpu.uuid, "the next notebook goes to the other host", people["admin"])
        again = start_notebook(page, base)
        assert again.host is not None and again.host.name == second
        lab = open_lab(page)
        read = contents(lab, "notes.txt")
        assert read["status"] == 200 and read["body"]["content"] == "epoch 3: loss 0.031\n", read
        shot(page, "notebook-sandbox-page")

        # Step 5: another user: 403 at the notebook's link in the portal, and at its own origin
        # (no app session there: round the portal, which refuses), and a home without the file.
        page.context.clear_cookies()
        sign_in(page, base, "mark", "/sandboxes/")
        refused = page.goto(f"{base}/sandboxes/{again.pk}/app/lab")
        assert refused is not None and refused.status == 403
        assert "Only the sandbox's owner" in page.content()
        refused = page.goto(f"{app_origin(again, platform)}/lab")
        assert refused is not None and refused.status == 403 and page.url.startswith(base)
        assert "Only the sandbox's owner" in page.content()
    homes = {p.name: p for p in (storage_root / "homes").iterdir()}
    assert list(homes) == [str(people["owner"].pk)]  # mark never ran a sandbox: no home was made
    assert (homes[str(people["owner"].pk)] / "notes.txt").read_text() == "epoch 3: loss 0.031\n"
