"""Chromium: a hostile app on its own origin cannot reach the portal (issue 34's acceptance).

Production's shape, not the easy one: the portal at ``https://gpus.test`` and apps at
``https://<sandbox>-<key>.apps.gpus.test``, one site (a cookie for ``gpus.test`` reaches both),
over TLS (a certificate Chromium trusts by its key, ``--ignore-certificate-errors-spki-list``,
so service workers register as on a real certificate), names resolved to loopback by the
browser (``--host-resolver-rules``). The real platform: web server, control worker, a Docker
agent. The app (tests/browser/hostile_app.py) plants cookies for the whole site, registers a
service worker for ``/`` with ``Service-Worker-Allowed: /``, tries to read a portal page and
to stop its sandbox through the portal. The review's probe did this on the portal's own
origin and then got its ``/login/`` and ``/projects/`` served by the app, even after the
sandbox had stopped. Here each step shows it cannot.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import SandboxImage
from portal.sandboxes.models import Sandbox
from tests.browser.conftest import chromium_page
from tests.browser.pages import SHOTS, sign_in
from tests.e2e.platform import Platform, running_platform, wait_for
from tests.workers.engines import require_engine
from workers.drivers.docker import docker_available

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SITE = "gpus.test"
APPS_DOMAIN = f"apps.{SITE}"
OWNED = "owned by the app"


@pytest.fixture(scope="class")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A certificate for the portal and every app origin, and its key's SPKI hash (what
    Chromium's --ignore-certificate-errors-spki-list takes)."""
    openssl = shutil.which("openssl")
    require_engine(openssl is not None, "openssl")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            str(openssl), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN={SITE}", "-addext", f"subjectAltName=DNS:{SITE},DNS:*.{APPS_DOMAIN}",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    public = subprocess.run(
        [str(openssl), "x509", "-pubkey", "-noout", "-in", str(cert)], check=True, capture_output=True
    ).stdout
    der = subprocess.run(
        [str(openssl), "pkey", "-pubin", "-outform", "der"], input=public, check=True, capture_output=True
    ).stdout
    return cert, key, base64.b64encode(hashlib.sha256(der).digest()).decode()


@pytest.fixture(scope="class")
def _scenario_chromium(tls: tuple[Path, Path, str]) -> Iterator[tuple[Any, list[str]]]:
    """This scenario's browser: the site's names on loopback, its certificate trusted."""
    resolve = f"--host-resolver-rules=MAP {SITE} 127.0.0.1, MAP *.{SITE} 127.0.0.1"
    with chromium_page((resolve, f"--ignore-certificate-errors-spki-list={tls[2]}")) as opened:
        yield opened


@pytest.fixture(scope="class")
def platform(
    world: dict[str, Any], tls: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    require_engine(docker_available(), "a Docker engine")
    built = subprocess.run(
        [REPO / "scripts" / "build-python-image.sh", "notebook"], capture_output=True, text=True, check=False
    )
    require_engine(built.returncode == 0, f"the notebook image, which has Python ({built.stderr[-500:]})")
    production = {
        "ALLOWED_HOSTS": f"{SITE},127.0.0.1",
        "APPS_DOMAIN": APPS_DOMAIN,
        "SESSION_COOKIE_SECURE": "true",
        "CSRF_COOKIE_SECURE": "true",
    }
    with running_platform(
        tmp_path_factory.mktemp("platform"), sim_gpus="A100-80GB:1", driver="docker", extra_env=production
    ) as platform:
        platform.start_web(tls=(tls[0], tls[1]), name=SITE)
        yield platform


@pytest.fixture
def portal(platform: Platform) -> str:
    return f"https://{SITE}:{platform.port}"


def hostile_image(portal: str) -> SandboxImage:
    program = (REPO / "tests" / "browser" / "hostile_app.py").read_text()
    program = program.replace('os.environ.get("HOSTILE_PORTAL", "")', repr(portal))
    return SandboxImage.objects.create(
        name="Hostile", reference="gpushare/notebook:1", command=["python3", "-c", program], app="Hostile app"
    )


def portal_cookies(page: Any, portal: str) -> dict[str, str]:
    return {c["name"]: c["value"] for c in page.context.cookies(portal)}


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestAHostileAppStaysOnItsOrigin:
    def test_01_the_owner_runs_the_app_and_signs_in_over_https(
        self, world: dict[str, Any], scenario_page: Any, portal: str, state: dict[str, Any]
    ) -> None:
        from tests.portal.helpers import request

        sandbox = request(world["owner"], world["project"], world["dedicated"], hostile_image(portal))
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "running", 120, "the hostile app to run")
        state["sandbox"] = Sandbox.objects.get(pk=sandbox.pk)
        sign_in(scenario_page, portal, "olivia", f"/sandboxes/{sandbox.pk}/")
        cookies = portal_cookies(scenario_page, portal)
        # The portal's cookies over HTTPS: __Host-, so no sibling origin can set them.
        assert {"__Host-sessionid", "__Host-csrftoken"} <= set(cookies), cookies
        state["portal_cookies"] = {k: v for k, v in cookies.items() if k.startswith("__Host-")}

    def test_02_the_app_opens_on_its_own_origin_and_does_its_worst(
        self, scenario_page: Any, portal: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        sandbox = state["sandbox"]
        origin = f"https://{sandbox.pk}-{sandbox.allocation_key}.{APPS_DOMAIN}:{platform.port}"
        assert origin in scenario_page.locator("#connect").inner_text()  # the page names it
        with scenario_page.context.expect_page() as opened:
            scenario_page.click("#open-app")
        app = opened.value
        app.wait_for_function("document.title === 'done'", timeout=60_000)
        log = app.locator("#log").inner_text()
        assert app.url == f"{origin}/"
        # Its worker took its own origin, and nothing more; the portal's page was not its to read.
        assert f"worker: {origin}/" in log, log
        assert "read portal: blocked" in log, log
        SHOTS.mkdir(parents=True, exist_ok=True)
        app.screenshot(path=str(SHOTS / "app-origin-hostile.png"))  # the app's page, not ours: no axe
        app.reload()
        assert OWNED in app.content()  # the worker owns the app's origin: its own business
        state["app"], state["origin"] = app, origin

    def test_03_the_portal_is_still_the_portals_own(
        self, scenario_page: Any, portal: str, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        for path in ("/projects/", f"/sandboxes/{state['sandbox'].pk}/"):
            answer = page.goto(f"{portal}{path}")
            assert answer is not None and answer.status == 200
            assert OWNED not in page.content() and "olivia" in page.locator("header").inner_text()
            assert "default-src 'self'" in (answer.headers.get("content-security-policy") or "")
        assert page.evaluate("navigator.serviceWorker.controller") is None
        assert page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)") == 0
        # Not a cookie of the portal's was replaced: the planted ones are not the portal's names,
        # and the __Host- ones cannot be set from another origin.
        cookies = portal_cookies(page, portal)
        assert {k: cookies.get(k) for k in state["portal_cookies"]} == state["portal_cookies"]
        # Its "stop" through the portal, with the user's cookies, was refused (CSRF).
        assert Sandbox.objects.get(pk=state["sandbox"].pk).state == "running"

    def test_04_another_user_is_refused_at_the_apps_url(
        self, scenario_page: Any, portal: str, state: dict[str, Any]
    ) -> None:
        other = scenario_page.context.browser.new_context()  # mark's own browser
        try:
            page = other.new_page()
            sign_in(page, portal, "mark", "/sandboxes/")
            refused = page.goto(f"{state['origin']}/")
            assert refused is not None and refused.status == 403 and page.url.startswith(portal)
            assert "Only the sandbox's owner" in page.content()
        finally:
            other.close()

    def test_05_after_the_sandbox_stops_the_portals_pages_are_still_its_own(
        self, scenario_page: Any, portal: str, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        sandbox = state["sandbox"]
        page.goto(f"{portal}/sandboxes/{sandbox.pk}/")
        page.click("#stop-button")  # the page's confirm() is accepted by the fixture
        wait_for(lambda: Sandbox.objects.get(pk=sandbox.pk).state == "stopped", 60, "the sandbox to stop")
        page.goto(f"{portal}/projects/")
        assert OWNED not in page.content() and page.locator("h1").first.inner_text() == "Projects"
        page.locator("form[action='/logout/'] button").click()
        page.goto(f"{portal}/login/")
        assert OWNED not in page.content() and page.locator("input[name=password]").count() == 1
        assert page.evaluate("navigator.serviceWorker.controller") is None
