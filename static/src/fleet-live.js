// The fleet console's live column: one WebSocket to /ws/fleet/ (staff only), each GPU's
// cell updated from its newest sample. Reconnects with backoff; a sample that does not
// look like one is ignored.
export function mountFleetLive(url) {
  const cells = new Map();
  document.querySelectorAll("[data-live-gpu]").forEach((cell) => cells.set(cell.dataset.liveGpu, cell));
  if (!cells.size) return;
  let delay = 1000;
  const connect = () => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${url}`);
    ws.onopen = () => { delay = 1000; };
    ws.onmessage = (event) => {
      let msg;
      try { msg = JSON.parse(event.data); } catch { return; }
      const cell = msg && msg.type === "gpu.sample" ? cells.get(msg.gpu) : null;
      if (!cell || typeof msg.temp_c !== "number") return;
      const gib = (mib) => (mib / 1024).toFixed(1);
      const throttled = Array.isArray(msg.throttle) && msg.throttle.length ? ` · throttled (${msg.throttle.join(", ")})` : "";
      cell.textContent = `${msg.temp_c.toFixed(0)} °C · ${msg.util_pct.toFixed(0)} % · ` +
        `${gib(msg.mem_used_mib)}/${gib(msg.mem_total_mib)} GiB · ${msg.power_w.toFixed(0)} W${throttled}`;
    };
    ws.onclose = () => { setTimeout(connect, delay); delay = Math.min(delay * 2, 30000); };
  };
  connect();
}
