// The fleet console's live column: each GPU's cell shows its newest sample from /ws/fleet/
// (staff only). The stream is shared with the page's alerts panel (live.js), which also
// reconnects it with backoff and slows it down while the tab is hidden.
import { liveSocket } from "./live.js";
import { pctText, validSample } from "./gpu-chart.js";

export function mountFleetLive(url) {
  const cells = new Map();
  document.querySelectorAll("[data-live-gpu]").forEach((cell) => cells.set(cell.dataset.liveGpu, cell));
  if (!cells.size) return;
  const gib = (mib) => (mib / 1024).toFixed(1);
  liveSocket(url).onMessage((msg) => {
    const cell = validSample(msg) ? cells.get(msg.gpu) : null;
    if (!cell) return;
    const throttled = Array.isArray(msg.throttle) && msg.throttle.length ? ` · throttled (${msg.throttle.join(", ")})` : "";
    cell.textContent = `${msg.temp_c.toFixed(0)} °C · ${pctText(msg.util_pct)} · ` +
      `${gib(msg.mem_used_mib)}/${gib(msg.mem_total_mib)} GiB · ${msg.power_w.toFixed(0)} W${throttled}`;
  });
}
