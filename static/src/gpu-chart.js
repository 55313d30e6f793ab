// Live GPU charts over a WebSocket: validates each sample before plotting, reconnects
// with backoff, and redraws less often while the tab is hidden.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

const WINDOW_S = 300; // seconds of history kept on screen
const NUMBER_FIELDS = ["t", "temp_c", "util_pct", "mem_used_mib", "mem_total_mib", "power_w"];

export function validSample(msg) {
  if (!msg || msg.type !== "gpu.sample" || typeof msg.gpu !== "string") return false;
  return NUMBER_FIELDS.every((k) => typeof msg[k] === "number" && Number.isFinite(msg[k]));
}

function makeChart(el, title, series, width) {
  const [left, right] = series;
  const axes = [{}, { scale: left.scale, label: left.axis }];
  if (right.scale !== left.scale) {
    axes.push({ scale: right.scale, label: right.axis, side: 1, grid: { show: false } });
  }
  const scales = { x: { time: true } };
  for (const s of series) if (s.range) scales[s.scale] = { range: s.range };
  const opts = { title, width, height: 240, scales, series: [{}, ...series], axes };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

export function mountGpuCharts(root) {
  const width = Math.max(320, Math.floor((root.clientWidth - 24) / 2));
  const left = document.createElement("div");
  const right = document.createElement("div");
  root.classList.add("chart-pair");
  root.append(left, right);
  const heat = makeChart(left, "Temperature and utilization", [
    { label: "Temperature °C", scale: "pct", axis: "°C / %", range: [0, 100], stroke: "#d9480f", width: 2 },
    { label: "Utilization %", scale: "pct", axis: "%", range: [0, 100], stroke: "#2457d6", width: 2 },
  ], width);
  const load = makeChart(right, "Memory and power", [
    { label: "Memory GiB", scale: "gib", axis: "GiB", range: (u, min, max) => [0, Math.max(1, max * 1.2)], stroke: "#7c3aed", width: 2 },
    { label: "Power W", scale: "w", axis: "W", range: (u, min, max) => [0, Math.max(100, max * 1.2)], stroke: "#15803d", width: 2 },
  ], width);
  const data = { t: [], temp: [], util: [], mem: [], power: [] };
  const status = document.getElementById("chart-status");
  let dirty = false;
  let samples = 0;

  function push(msg) {
    const t = msg.t / 1000;
    data.t.push(t); data.temp.push(msg.temp_c); data.util.push(msg.util_pct);
    data.mem.push(msg.mem_used_mib / 1024); data.power.push(msg.power_w);
    while (data.t.length && data.t[0] < t - WINDOW_S) {
      for (const k of Object.keys(data)) data[k].shift();
    }
    samples += 1;
    dirty = true;
    root.dataset.samples = String(samples);
    if (status) {
      const sim = msg.simulated ? " (simulated GPU)" : "";
      status.textContent = `${msg.gpu}${sim} · ${msg.temp_c.toFixed(0)} °C · ${msg.util_pct.toFixed(0)} % · ` +
        `${(msg.mem_used_mib / 1024).toFixed(1)} / ${(msg.mem_total_mib / 1024).toFixed(0)} GiB · ${msg.power_w.toFixed(0)} W`;
    }
  }

  function redraw() {
    if (!dirty) return;
    dirty = false;
    heat.setData([data.t, data.temp, data.util]);
    load.setData([data.t, data.mem, data.power]);
  }
  // Visible: redraw every second; hidden: every 10 s (samples still buffer).
  let timer = setInterval(redraw, 1000);
  document.addEventListener("visibilitychange", () => {
    clearInterval(timer);
    timer = setInterval(redraw, document.hidden ? 10000 : 1000);
    if (!document.hidden) redraw();
  });

  let backoff = 1000;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${root.dataset.ws}`);
    ws.onopen = () => { backoff = 1000; };
    ws.onmessage = (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch { return; }
      if (validSample(msg)) push(msg);
    };
    ws.onclose = (ev) => {
      if (ev.code === 4403) {
        if (status) status.textContent = "You may not watch this GPU.";
        return; // refused: retrying would not help
      }
      if (status && !samples) status.textContent = "Reconnecting…";
      setTimeout(connect, backoff + Math.random() * 250);
      backoff = Math.min(backoff * 2, 30000);
    };
  }
  connect();
}
