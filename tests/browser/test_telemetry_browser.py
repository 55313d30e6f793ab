"""Chromium through Playwright: live telemetry in the browser.

A running sandbox on a simulated host: its charts take the rollup history and then move with
the live samples, slow down while the tab is hidden, and an alert shows (and clears) live; the
admin's GPU page does the same for one GPU; the fleet heatmap draws every GPU of a 200-GPU
fleet with a live column. Screenshots go to docs/screenshots/telemetry-*.png.
"""

from __future__ import annotations

import math
import os
import random
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from tests.browser.pages import SHOTS, accessibility_problems, publish, shot, sign_in, wait_until
from tests.e2e.platform import running_platform, wait_for
from tests.workers.engines import require_engine

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]
RACKS, PER_RACK = 25, 8  # beside the platform's 3 GPUs: a fleet of 203


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


def test_live_charts_heatmap_and_alerts(people: Any, catalog: Any, tmp_path: Path, browser_page: Any) -> None:
    from portal.fleet.models import Gpu
    from portal.sandboxes.models import Sandbox
    from portal.telemetry.models import Alert, SandboxRollup
    from tests.conftest import seed_host
    from tests.portal.helpers import request
    from workers.drivers.docker import docker_available
    from workers.telemetry import FLEET_GROUP, gpu_group, sandbox_group

    require_engine(docker_available(), "a Docker engine")
    page = browser_page
    started = timezone.now()
    with running_platform(tmp_path, web=True, sim_gpus="H100-80GB:3:mig=2") as platform:
        base = f"http://127.0.0.1:{platform.port}"
        sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
        wait_for(
            lambda: Sandbox.objects.filter(pk=sandbox.pk, state="running").exists(), 60, "the sandbox to run"
        )
        gpu = Gpu.objects.get(allocations__sandbox=sandbox, allocations__active=True)
        # The rest of the fleet, once the sandbox is placed: these hosts have no agent.
        for rack in range(RACKS):
            seed_host(f"rack-{rack:02d}", f"A100-80GB:{PER_RACK}")
        seed_gpu_history(platform.host, started)
        fleet_size = Gpu.objects.count()
        assert fleet_size == RACKS * PER_RACK + 3
        # The sandbox's first one-minute rollup comes when its first minute closes.
        wait_for(lambda: SandboxRollup.objects.filter(sandbox=sandbox).exists(), 90, "a sandbox rollup", 1)

        # --- The sandbox page: history, then live samples; the chart moves. ---
        sign_in(page, base, "olivia", f"/sandboxes/{sandbox.pk}/")
        chart = "#gpu-chart"
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3", timeout=30_000
        )
        samples, points = numbers(page, chart, "samples", "points")
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {samples + 2} && "
            f"Number(document.getElementById('gpu-chart').dataset.points) > {points}",
            timeout=30_000,
        )
        assert numbers(page, chart, "history-minutes")[0] >= 1  # the rollup came first
        assert page.locator("#gpu-chart canvas").count() == 2
        assert page.locator("#cost-chart canvas").count() == 1
        status = page.locator("#chart-status").inner_text()
        assert "Live: connected" in status and "simulated GPU" in status and "so far" in status, status

        # Hidden tab: the page asks for one sample every 10 s and says so.
        page.evaluate(
            "() => { Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});"
            " document.dispatchEvent(new Event('visibilitychange')); }"
        )
        assert "Tab hidden" in page.locator("#chart-status").inner_text()
        time.sleep(1)  # the interval reaches the server; what was under way still arrives
        (hidden_from,) = numbers(page, chart, "samples")
        time.sleep(5)
        (hidden_to,) = numbers(page, chart, "samples")
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
        (visible_to,) = numbers(page, chart, "samples")

        # An alert raised live shows among the open ones; cleared, it moves to the recent ones.
        key = f"{platform.host}:{gpu.uuid}:temperature:{sandbox.pk}"
        text = "GPU at 91 °C, over the 85 °C limit"
        publish(
            sandbox_group(sandbox.pk),
            alert("raised", key, "temperature", platform.host, gpu.uuid, sandbox.pk, text),
        )
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text=text).wait_for(timeout=10_000)
        page.locator("#alerts-panel").scroll_into_view_if_needed()
        wait_until(
            page,
            f"Number(document.getElementById('gpu-chart').dataset.samples) > {visible_to + 2}",
            timeout=30_000,
        )
        shot(page, "telemetry-sandbox")
        publish(
            sandbox_group(sandbox.pk),
            alert("cleared", key, "temperature", platform.host, gpu.uuid, sandbox.pk, text),
        )
        page.locator("#alerts-panel [data-alerts-recent] li.alert", has_text=text).wait_for(timeout=10_000)
        assert page.locator("#alerts-panel [data-alerts-open] li.alert").count() == 0

        # --- The fleet console: stored alerts, a live one, links to GPU pages and the heatmap. ---
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
            FLEET_GROUP,
            alert("raised", "rack-03:xid", "xid", "rack-03", "", None, "XID 79: GPU fell off the bus"),
        )
        panel.locator("[data-alerts-open] li.alert", has_text="XID 79").wait_for(timeout=10_000)
        assert panel.locator("[data-alerts-recent] li.alert", has_text=text).count() == 0  # never stored
        problems = accessibility_problems(page)
        assert not problems, problems
        # The top of the page only: 200-odd GPU rows follow.
        page.screenshot(path=str(SHOTS / "telemetry-fleet.png"))
        page.locator(f"a[href='/console/gpus/{gpu.uuid}/']").first.click()
        page.wait_for_url(f"{base}/console/gpus/{gpu.uuid}/")

        # --- The GPU page: an hour of history with its bands, live samples, its alerts. ---
        wait_until(
            page, "Number(document.getElementById('gpu-chart').dataset.samples || 0) >= 3", timeout=30_000
        )
        samples, points = numbers(page, chart, "samples", "points")
        wait_until(
            page, f"Number(document.getElementById('gpu-chart').dataset.points) > {points}", timeout=30_000
        )
        # The last hour: seeded minutes up to the agent's start, its own rollups after; the
        # newest finished minute may still be on its way to the control worker.
        assert numbers(page, chart, "history-minutes")[0] >= 59
        facts = page.locator("#gpu-facts").inner_text()
        assert platform.host in facts and "simulated GPU" in facts and f"#{sandbox.pk}" in facts, facts
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text="Clocks held down").wait_for()
        publish(
            gpu_group(gpu.uuid),
            alert("raised", f"{key}:gpu", "temperature", platform.host, gpu.uuid, None, "GPU at 88 °C"),
        )
        page.locator("#alerts-panel [data-alerts-open] li.alert", has_text="GPU at 88 °C").wait_for(
            timeout=10_000
        )
        shot(page, "telemetry-gpu")

        # --- The heatmap: every GPU, an hour of minutes, a live column. ---
        page.goto(f"{base}/console/fleet/")
        page.click("h1 >> text=heatmap")
        page.wait_for_url(f"{base}/console/heatmap/")
        heatmap = "#heatmap"
        wait_until(page, f"Number(document.querySelector('{heatmap}').dataset.rows) === {fleet_size}")
        wait_until(
            page, f"Number(document.querySelector('{heatmap}').dataset.liveSamples || 0) >= 3", timeout=30_000
        )
        grid = page.locator("canvas.heatmap-grid").bounding_box()
        assert grid is not None
        cell_w = (grid["width"] - 150 - 4) / 61
        row_h = max(3, min(20, 640 // fleet_size))
        assert grid["height"] >= fleet_size * row_h  # a row for every GPU

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
        page.select_option("select[name=metric]", "temp_c")
        page.locator("[data-legend-max]", has_text="°C").wait_for()
        page.select_option("select[name=metric]", "util_pct")
        page.locator("[data-legend-max]", has_text="100 %").wait_for()
        draws = page.locator(heatmap).get_attribute("data-draws")
        wait_until(page, f"document.querySelector('{heatmap}').dataset.draws !== '{draws}'", timeout=10_000)
        print(
            f"heatmap of {fleet_size} GPUs x 61 minutes: "
            f"drawn in {page.locator(heatmap).get_attribute('data-draw-ms')} ms"
        )
        page.mouse.move(grid["x"] + 150 + cell_w * 45.5, grid["y"] + row_h * 1.5)
        shot(page, "telemetry-heatmap")
    assert os.path.exists(
        Path(__file__).resolve().parents[2] / "docs" / "screenshots" / "telemetry-heatmap.png"
    )
