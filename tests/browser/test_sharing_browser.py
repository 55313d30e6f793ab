"""Chromium through Playwright: tenants sharing one time-sliced GPU (issue 36's acceptance).

Two tenants on one time-sliced GPU of a simulated host, one busy and one idle: each sandbox's
page shows its own utilization (its processes', not the GPU's), and the idle one is culled
by the tier's idle rule while the busy one is not. Then a tenant holds more GPU memory than
its replica's share (the GPU's memory over its replicas): it is warned at once and stopped
after the tier's grace, and its neighbour keeps running.

The simulated driver runs nothing: a sandbox's batch command ``gpushare-sim-load util=..
mem_mib=..`` chooses what it puts on its simulated GPU (``workers.drivers.simulated``), so
the agent measures a busy, an idle and an over-share tenant as it would real processes. One
platform and one page for the scenario's steps; screenshots go to sharing-*.png.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.browser.pages import request_batch, shot, sign_in, wait_until
from tests.conftest import make_catalog, make_people
from tests.e2e.platform import Platform, running_platform, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow]
GRACE_S = 20  # the tier's grace over the memory share: long enough to see the warning
BUSY, IDLE = "gpushare-sim-load util=90", "gpushare-sim-load util=0"
OVER = "gpushare-sim-load util=40 mem_mib=30000"  # a replica's share of an 80 GB A100: 20480 MiB


@pytest.fixture(scope="class")
def world(scenario_db: None) -> dict[str, Any]:
    """The personas and the catalog; the time-slice tier culls a sandbox under 10 % of its
    GPU (warned at once, stopped a minute later) and stops one GRACE_S over its memory share."""
    world = {**make_people(), **make_catalog()}
    tier = world["timeslice"]
    tier.idle_util_pct, tier.idle_minutes, tier.idle_grace_minutes = 10, 0, 1
    tier.over_share, tier.over_share_grace = "stop", timedelta(seconds=GRACE_S)
    tier.save()
    return world


@pytest.fixture(scope="class")
def platform(world: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One A100 pinned to time-slicing (4 replicas), on a host whose driver keeps state only;
    utilization is judged over 10 s windows instead of 10 minutes."""
    from portal.fleet.models import Gpu

    with running_platform(
        tmp_path_factory.mktemp("platform"),
        web=True,
        sim_gpus="A100-80GB:1",
        driver="simulated",
        extra_env={"UTIL_WINDOW_S": "10"},
    ) as platform:
        Gpu.objects.filter(host__name=platform.host).update(sharing_mode="timeslice")
        yield platform


@pytest.fixture(scope="class")
def state() -> dict[str, Any]:
    return {}


@pytest.fixture
def base(platform: Platform) -> str:
    return f"http://127.0.0.1:{platform.port}"


def request_on_the_shared_gpu(page: Any, base: str, who: str, command: str) -> int:
    """``who`` (whoever was signed in before is not) asks for a time-slice replica running
    ``command``; the sandbox's id."""
    page.context.clear_cookies()
    return request_batch(page, base, command, who, tier="Timeslice", isolation="container")


def sign_in_as(page: Any, base: str, who: str, then: str) -> None:
    """Whoever was signed in is not any more (the session cookie goes), then ``who`` is."""
    page.context.clear_cookies()
    sign_in(page, base, who, then)


def sandbox(pk: int) -> Any:
    from portal.sandboxes.models import Sandbox

    return Sandbox.objects.select_related("tier").get(pk=pk)


def running_on_one_gpu(*pks: int) -> set[str]:
    from portal.sandboxes.models import Allocation

    return set(
        Allocation.objects.filter(sandbox_id__in=pks, active=True, sandbox__state="running").values_list(
            "gpu__uuid", flat=True
        )
    )


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestTenantsSharingOneTimeSlicedGpu:
    def test_01_a_busy_and_an_idle_tenant_run_on_one_time_sliced_gpu(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        state["busy"] = request_on_the_shared_gpu(page, base, "olivia", BUSY)
        state["idle"] = request_on_the_shared_gpu(page, base, "mark", IDLE)
        both = (state["busy"], state["idle"])
        wait_for(lambda: len(running_on_one_gpu(*both)) == 1 and all(
            sandbox(pk).state == "running" for pk in both
        ), 60, platform.logs)  # fmt: skip
        assert sandbox(state["busy"]).allocations.get(active=True).kind == "timeslice"

    def test_02_each_sandbox_page_shows_its_own_utilization(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        wait_for(
            lambda: all(sandbox(pk).gpu_util_pct is not None for pk in (state["busy"], state["idle"])),
            60,
            platform.logs,
        )
        busy, idle = sandbox(state["busy"]), sandbox(state["idle"])
        assert busy.gpu_util_pct is not None and busy.gpu_util_pct >= 50, busy.gpu_util_pct
        assert idle.gpu_util_pct is not None and idle.gpu_util_pct < 10, idle.gpu_util_pct
        page.goto(f"{base}/sandboxes/{state['idle']}/")  # mark's own
        page.locator("#status", has_text="GPU use").wait_for()
        text = page.locator("#status").inner_text()
        assert re.search(r"GPU use\s+0%", text, re.IGNORECASE), text
        page.locator("#idle-warning").wait_for(timeout=30_000)  # the tier warns at once
        wait_until(page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3")
        shot(page, "sharing-idle-tenant")
        sign_in_as(page, base, "olivia", f"/sandboxes/{state['busy']}/")
        page.locator("#status", has_text="GPU use").wait_for()
        text = page.locator("#status").inner_text()
        assert re.search(r"GPU use\s+[5-9]\d%", text, re.IGNORECASE), text
        assert page.locator("#idle-warning").count() == 0
        wait_until(page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3")
        shot(page, "sharing-busy-tenant")

    def test_03_the_idle_one_is_culled_by_the_tiers_rule_and_the_busy_one_is_not(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        wait_for(lambda: sandbox(state["idle"]).state == "stopped", 120, platform.logs, every=1)
        idle, busy = sandbox(state["idle"]), sandbox(state["busy"])
        assert idle.stop_cause == "culled"
        assert busy.state == "running" and busy.idle_warned_at is None
        page = scenario_page
        sign_in_as(page, base, "mark", f"/sandboxes/{state['idle']}/")
        timeline = page.locator("#events").inner_text()
        assert "culled: GPU utilization under 10%" in timeline, timeline
        shot(page, "sharing-idle-culled")

    def test_04_a_tenant_over_its_memory_share_is_warned_at_once(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        state["over"] = request_on_the_shared_gpu(page, base, "mark", OVER)
        wait_for(lambda: sandbox(state["over"]).over_share_since is not None, 60, platform.logs)
        assert running_on_one_gpu(state["over"]) == running_on_one_gpu(state["busy"])
        page.reload()  # loaded while it queued: the page as it is now it runs
        warning = page.locator("#over-share-warning")
        warning.wait_for(timeout=10_000)
        assert "holds 29.3 GiB of its 20.0 GiB" in warning.inner_text(), warning.inner_text()
        assert "It is stopped at" in warning.inner_text()
        from portal.sandboxes.models import Notification

        note = Notification.objects.get(sandbox_id=state["over"], kind="over_share")
        assert "share of GPU memory" in note.message and f"stopped after {GRACE_S} s" in note.message
        wait_until(page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3")
        shot(page, "sharing-over-share-warned")

    def test_05_then_stopped_after_the_grace_and_its_neighbour_keeps_running(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        wait_for(lambda: sandbox(state["over"]).state == "stopped", GRACE_S + 60, platform.logs, every=1)
        over, busy = sandbox(state["over"]), sandbox(state["busy"])
        assert over.stop_cause == "over_share"
        assert busy.state == "running"
        [usage] = over.usage.all()
        assert usage.ended_at == over.ended_at  # billed to the stop, not a moment beyond
        page = scenario_page
        page.reload()
        stop = page.locator("#over-share-stop")
        stop.wait_for(timeout=10_000)
        said = stop.inner_text()  # over for the grace, and the time its report took to arrive
        assert re.search(r"Stopped: it held 29.3 GiB of its 20.0 GiB share for (2\d|3\d) s", said), said
        assert "GPU memory share on GPU-" in page.locator("#events").inner_text()
        shot(page, "sharing-over-share-stopped")
        sign_in_as(page, base, "olivia", f"/sandboxes/{state['busy']}/")
        assert page.locator("#sandbox-state").inner_text() == "Running"
