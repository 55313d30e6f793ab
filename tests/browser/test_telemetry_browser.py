"""Chromium through Playwright: live telemetry in the browser.

A running sandbox on a simulated host: its charts take the rollup history and then move with
the live samples, slow down while the tab is hidden, and an alert shows (and clears) live; the
admin's GPU page does the same for one GPU; the fleet heatmap draws every GPU of a 200-GPU
fleet with a live column. One platform and one page for the scenario's steps (a class marked
``steps``): a failure names the step. Screenshots go to docs/screenshots/telemetry-*.png.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from tests.browser.pages import SHOTS, accessibility_problems, publish, shot, sign_in, wait_until
from tests.conftest import make_catalog, make_people
from tests.e2e.platform import Platform, running_platform, wait_for
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.slow,
]
RACKS, PER_RACK = 25, 8  # beside the platform's 3 GPUs: a fleet of 203
CHART = "#gpu-chart"
HEATMAP = "#heatmap"
HOT = "GPU at 91 °C, over the 85 °C limit"


def alert(
    state: str, key: str, kind: str, host: str, gpu: str, sandbox: int | None, message: str
) -> dict[str, Any]:
    return {
        "type": "alert.changed",
        "key": key,
        "state": state,
        "kind": kind,
        "host": host,
        "gpu": gpu,
        "sandbox": sandbox,
        "value": 91.0,
        "threshold": 85.0,
        "message": message,
        "t": int(time.time() * 1000),
    }


def seed_gpu_history(agent_host: str, agent_started: datetime) -> None:
    """An hour of one-minute rollups for every GPU: busy hosts, idle ones, one running hot. The
    platform's own GPUs' hour ends when its agent started, so no minute collides with one the
    agent reports; the racks (no agent) have theirs up to the minute before this one."""
    from portal.fleet.models import Gpu
    from portal.telemetry.models import GpuRollup

    rng = random.Random(6)
    rows = []
    for g, gpu in enumerate(Gpu.objects.select_related("host").order_by("host__name", "index")):
        end = agent_started if gpu.host.name == agent_host else timezone.now()
        end = end.replace(second=0, microsecond=0)
        load = rng.choice([0.05, 0.3, 0.6, 0.9])
        hot = 12 if g % 37 == 5 else 0
        for m in range(60, 0, -1):
            util = max(0.0, min(100.0, 100 * load + 20 * math.sin((m + g) / 7) + rng.uniform(-8, 8)))
            temp = 32 + util * 0.45 + hot + rng.uniform(-2, 2)
            mem = int(gpu.memory_mib * min(0.98, load + rng.uniform(-0.05, 0.05)))
            power = 70 + util * 5.5 + rng.uniform(-10, 10)
            rows.append(
                GpuRollup(
                    gpu=gpu,
                    minute=end - timedelta(minutes=m),
                    samples=60,
                    temp_min_c=temp - 3,
                    temp_mean_c=temp,
                    temp_max_c=temp + 3,
                    util_min_pct=max(0.0, util - 15),
                    util_mean_pct=util,
                    util_max_pct=min(100.0, util + 12),
                    mem_min_mib=max(0, mem - 2048),
                    mem_mean_mib=mem,
                    mem_max_mib=min(gpu.memory_mib, mem + 2048),
                    mem_total_mib=gpu.memory_mib,
                    power_min_w=power - 40,
                    power_mean_w=power,
                    power_max_w=power + 40,
                    sm_clock_mean_mhz=1755,
                )
            )
    GpuRollup.objects.bulk_create(rows, batch_size=2000, ignore_conflicts=True)


def numbers(page: Any, selector: str, *names: str) -> list[float]:
    return [float(page.locator(selector).get_attribute(f"data-{n}") or 0) for n in names]


@pytest.fixture(scope="class")
def world(scenario_db: None) -> dict[str, Any]:
    return {**make_people(), **make_catalog()}


@pytest.fixture(scope="class")
def state() -> dict[str, Any]:
    """What a step found that a later one uses (the sandbox, its GPU, the fleet's size...)."""
    return {"started": timezone.now()}


@pytest.fixture(scope="class")
def platform(
    world: Any, state: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    state["started"] = timezone.now()
    with running_platform(
        tmp_path_factory.mktemp("platform"), web=True, sim_gpus="H100-80GB:3:mig=2"
    ) as platform:
        yield platform


@pytest.fixture
def base(platform: Platform) -> str:
    return f"http://127.0.0.1:{platform.port}"


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestLiveChartsHeatmapAndAlerts:
    def test_01_a_sandbox_runs_on_the_simulated_host(
        self, world: dict[str, Any], platform: Platform, state: dict[str, Any]
    ) -> None:
        from portal.fleet.models import Gpu
        from portal.sandboxes.models import Sandbox
        from tests.portal.helpers import request

        sandbox = request(world["owner"], world["project"], world["dedicated"], world["image"])
        wait_for(
            lambda: Sandbox.objects.filter(pk=sandbox.pk, state="running").exists(), 60, "the sandbox to run"
        )
        state["sandbox"] = sandbox
        state["gpu"] = Gpu.objects.get(allocations__sandbox=sandbox, allocations__active=True)

    def test_02_a_fleet_of_203_gpus_with_an_hour_of_history(
        self, platform: Platform, state: dict[str, Any]
    ) -> None:
        from portal.fleet.models import Gpu
        from tests.conftest import seed_host

        # The rest of the fleet, once the sandbox is placed: these hosts have no agent.
        for rack in range(RACKS):
            seed_host(f"rack-{rack:02d}", f"A100-80GB:{PER_RACK}")
        seed_gpu_history(platform.host, state["started"])
        state["fleet_size"] = Gpu.objects.count()
        assert state["fleet_size"] == RACKS * PER_RACK + 3

    def test_03_the_sandbox_gets_its_first_minute_rollup(self, state: dict[str, Any]) -> None:
        from portal.telemetry.models import SandboxRollup

        # The sandbox's first one-minute rollup comes when its first minute closes.
        wait_for(
            lambda: SandboxRollup.objects.filter(sandbox=state["sandbox"]).exists(), 90, "a sandbox rollup", 1
        )

    def test_04_the_sandbox_chart_takes_the_history_then_moves_live(
        self, scenario_page: Any, base: str, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        sign_in(page, base, "olivia", f"/sandboxes/{state['sandbox'].pk}/")
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3", timeout=30_000
        )
        samples, points = numbers(page, CHART, "samples", "points")
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {samples + 2} && "
            f"Number(document.getElementById('gpu-chart').dataset.points) > {points}",
            timeout=30_000,
        )
        assert numbers(page, CHART, "history-minutes")[0] >= 1  # the rollup came first
        assert page.locator("#gpu-chart canvas").count() == 2
        assert page.locator("#cost-chart canvas").count() == 1
        status = page.locator("#chart-status").inner_text()
        assert "Live: connected" in status and "simulated GPU" in status and "so far" in status, status

    def test_05_a_hidden_tab_gets_a_sample_every_10_s_and_the_stream_resumes_when_shown(
        self, scenario_page: Any, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        page.evaluate(
            "() => { Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});"
            " document.dispatchEvent(new Event('visibilitychange')); }"
        )
        assert "Tab hidden" in page.locator("#chart-status").inner_text()
        time.sleep(1)  # the interval reaches the server; what was under way still arrives
        (hidden_from,) = numbers(page, CHART, "samples")
        time.sleep(5)
        (hidden_to,) = numbers(page, CHART, "samples")
        page.evaluate(
            "() => { Object.defineProperty(document, 'hidden', {configurable: true, get: () => false});"
            " document.dispatchEvent(new Event('visibilitychange')); }"
        )
        # Shown again: the full stream resumes (once the server's hidden-tab pause is over).
        shown = time.monotonic()
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {hidden_to + 4}",
            timeout=20_000,
        )
        print(
            f"samples in 5 s hidden: {hidden_to - hidden_from:.0f}; "
            f"5 more {time.monotonic() - shown:.1f} s after shown"
        )
        assert hidden_to - hidden_from <= 2
        (state["visible_to"],) = numbers(page, CHART, "samples")

    def test_06_a_live_alert_shows_among_the_open_ones(
        self, scenario_page: Any, platform: Platform, state: dict[str, Any]
    ) -> None:
        from wire.telemetry import host_sandbox_group

        page, sandbox, gpu = scenario_page, state["sandbox"], state["gpu"]
        state["key"] = key = f"{platform.host}:{gpu.uuid}:temperature:{sandbox.pk}"
        publish(
            host_sandbox_group(platform.host, sandbox.pk),
            alert("raised", key, "temperature", platform.host, gpu.uuid, sandbox.pk, HOT),
        )
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text=HOT).wait_for(timeout=10_000)
        page.locator("#alerts-panel").scroll_into_view_if_needed()
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {state['visible_to'] + 2}",
            timeout=30_000,
        )
        shot(page, "telemetry-sandbox")

    def test_07_the_alert_cleared_moves_to_the_recent_ones(
        self, scenario_page: Any, platform: Platform, state: dict[str, Any]
    ) -> None:
        from wire.telemetry import host_sandbox_group

        page, sandbox, gpu = scenario_page, state["sandbox"], state["gpu"]
        publish(
            host_sandbox_group(platform.host, sandbox.pk),
            alert("cleared", state["key"], "temperature", platform.host, gpu.uuid, sandbox.pk, HOT),
        )
        page.locator("#alerts-panel [data-alerts-recent] li.alert", has_text=HOT).wait_for(timeout=10_000)
        assert page.locator("#alerts-panel [data-alerts-open] li.alert").count() == 0

    def test_08_the_fleet_console_shows_stored_and_live_alerts(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        from portal.telemetry.models import Alert
        from wire.telemetry import fleet_group

        page, gpu = scenario_page, state["gpu"]
        Alert.objects.create(
            key=f"{platform.host}:{gpu.uuid}:throttle",
            kind="throttle",
            host=gpu.host,
            gpu=gpu,
            message="Clocks held down (hw_thermal) for 40 s",
            value=40,
            threshold=30,
            raised_at=timezone.now() - timedelta(minutes=3),
        )
        page.click("text=Sign out")
        sign_in(page, base, "ada", "/console/fleet/")
        panel = page.locator("#alerts-panel")
        panel.locator("[data-alerts-open] li.alert", has_text="Clocks held down").wait_for(timeout=10_000)
        # A group message reaches only sockets already in the group: wait until the page's
        # fleet socket has had a sample (the alerts panel shares it) before the live alert.
        wait_until(
            page,
            "[...document.querySelectorAll('[data-live-gpu]')].some(c => c.textContent.includes('°C'))",
            timeout=30_000,
        )
        publish(
            fleet_group("rack-03"),
            alert("raised", "rack-03:xid", "xid", "rack-03", "", None, "XID 79: GPU fell off the bus"),
        )
        panel.locator("[data-alerts-open] li.alert", has_text="XID 79").wait_for(timeout=10_000)
        assert panel.locator("[data-alerts-recent] li.alert", has_text=HOT).count() == 0  # never stored
        problems = accessibility_problems(page)
        assert not problems, problems
        # The top of the page only: 200-odd GPU rows follow.
        page.screenshot(path=str(SHOTS / "telemetry-fleet.png"))

    def test_09_the_gpu_page_shows_an_hour_of_history_live_samples_and_alerts(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        from wire.telemetry import gpu_group

        page, sandbox, gpu = scenario_page, state["sandbox"], state["gpu"]
        page.locator(f"a[href='/console/gpus/{gpu.uuid}/']").first.click()
        page.wait_for_url(f"{base}/console/gpus/{gpu.uuid}/")
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3", timeout=30_000
        )
        (points,) = numbers(page, CHART, "points")
        wait_until(
            page, f"Number(document.getElementById('gpu-chart').dataset.points) > {points}", timeout=30_000
        )
        # The last hour: seeded minutes up to the agent's start, its own rollups after; the
        # newest finished minute may still be on its way to the control worker.
        assert numbers(page, CHART, "history-minutes")[0] >= 59
        facts = page.locator("#gpu-facts").inner_text()
        assert platform.host in facts and "simulated GPU" in facts and f"#{sandbox.pk}" in facts, facts
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text="Clocks held down").wait_for()
        publish(
            gpu_group(platform.host, gpu.uuid),
            alert(
                "raised", f"{state['key']}:gpu", "temperature", platform.host, gpu.uuid, None, "GPU at 88 °C"
            ),
        )
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text="GPU at 88 °C").wait_for(
            timeout=10_000
        )
        shot(page, "telemetry-gpu")

    def test_10_the_heatmap_has_a_row_for_every_gpu_and_a_live_column(
        self, scenario_page: Any, base: str, platform: Platform, state: dict[str, Any]
    ) -> None:
        page, fleet_size = scenario_page, state["fleet_size"]
        page.goto(f"{base}/console/fleet/")
        page.click("h1 >> text=heatmap")
        page.wait_for_url(f"{base}/console/heatmap/")
        wait_until(page, f"Number(document.querySelector('{HEATMAP}').dataset.rows) === {fleet_size}")
        wait_until(
            page, f"Number(document.querySelector('{HEATMAP}').dataset.liveSamples || 0) >= 3", timeout=30_000
        )
        # The canvas is sized by a draw, which follows the samples by up to a second (or the
        # history's load): measure it after a draw that came after them.
        (draws,) = numbers(page, HEATMAP, "draws")
        drawn = f"Number(document.querySelector('{HEATMAP}').dataset.draws) > {draws}"
        wait_until(page, drawn, timeout=15_000)
        grid = page.locator("canvas.heatmap-grid").bounding_box()
        assert grid is not None
        cell_w = (grid["width"] - 150 - 4) / 61
        row_h = max(3, min(20, 640 // fleet_size))
        assert grid["height"] >= fleet_size * row_h  # a row for every GPU
        state["grid"] = grid, cell_w, row_h

        def hover(slot: float, row: int) -> str:
            page.mouse.move(grid["x"] + 150 + cell_w * slot, grid["y"] + row_h * (row + 0.5))
            return page.locator(".heatmap-tip").inner_text()

        # Rows are ordered host/index: the platform's host sorts before the racks.
        live_tip = hover(60.5, 0)
        assert f"{platform.host}/gpu0" in live_tip and "live" in live_tip and "no data" not in live_tip, (
            live_tip
        )
        old_tip = hover(30.5, fleet_size - 1)
        assert f"rack-{RACKS - 1:02d}/gpu{PER_RACK - 1}" in old_tip and "%" in old_tip, old_tip
        assert "no data" not in old_tip, old_tip

    def test_11_the_heatmap_redraws_for_another_metric(
        self, scenario_page: Any, state: dict[str, Any]
    ) -> None:
        page = scenario_page
        page.select_option("select[name=metric]", "temp_c")
        page.locator("[data-legend-max]", has_text="°C").wait_for()
        page.select_option("select[name=metric]", "util_pct")
        page.locator("[data-legend-max]", has_text="100 %").wait_for()
        draws = page.locator(HEATMAP).get_attribute("data-draws")
        wait_until(page, f"document.querySelector('{HEATMAP}').dataset.draws !== '{draws}'", timeout=10_000)
        print(
            f"heatmap of {state['fleet_size']} GPUs x 61 minutes: "
            f"drawn in {page.locator(HEATMAP).get_attribute('data-draw-ms')} ms"
        )
        grid, cell_w, row_h = state["grid"]
        page.mouse.move(grid["x"] + 150 + cell_w * 45.5, grid["y"] + row_h * 1.5)
        shot(page, "telemetry-heatmap")
        assert os.path.exists(SHOTS / "telemetry-heatmap.png")
