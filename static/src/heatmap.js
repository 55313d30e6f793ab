// The admin fleet heatmap: one row per GPU, one column per minute of the last hour (the
// fleet history endpoint's per-minute means), and a live column for the current minute fed
// by the /ws/fleet/ samples. uPlot draws no heatmaps, so this is a canvas: the cells are
// written as one pixel each into an ImageData and scaled up in a single drawImage, which keeps
// a redraw well under a millisecond at 200 GPUs (12,200 cells).
import { liveSocket, describeStatus } from "./live.js";
import { getJson } from "./gpu-chart.js";

const SLOTS = 61; // 60 history minutes and the live one
const GUTTER = 150; // CSS px for the row labels
const AXIS = 24; // CSS px for the time axis under the grid
const NO_DATA = [229, 231, 235];
// Viridis: perceptually even and readable by the colour-blind.
const STOPS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"]
  .map((hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)));
const LUT = Array.from({ length: 256 }, (_, i) => {
  const f = (i / 255) * (STOPS.length - 1);
  const lo = Math.floor(f);
  const hi = Math.min(lo + 1, STOPS.length - 1);
  return STOPS[lo].map((c, k) => Math.round(c + (STOPS[hi][k] - c) * (f - lo)));
});

const finite = (v) => typeof v === "number" && Number.isFinite(v);
export const METRICS = {
  util_pct: { label: "Utilization", unit: "%", of: (m) => m.util_pct, range: () => [0, 100] },
  temp_c: { label: "Temperature", unit: "°C", of: (m) => m.temp_c, range: () => [20, 90] },
  mem_pct: {
    label: "Memory used", unit: "%", range: () => [0, 100],
    of: (m) => (m.mem_total_mib > 0 ? (100 * m.mem_used_mib) / m.mem_total_mib : null),
  },
  power_w: {
    label: "Power", unit: "W", of: (m) => m.power_w,
    range: (max) => [0, Math.max(100, Math.ceil((max || 0) / 50) * 50)],
  },
};
const hhmm = (s) => new Date(s * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

export function mountHeatmap(root) {
  const canvas = root.querySelector("canvas.heatmap-grid");
  const tip = root.querySelector(".heatmap-tip");
  const select = root.querySelector("select[name=metric]");
  const statusEl = root.querySelector("[data-heatmap-status]");
  const legend = root.querySelector("canvas.heatmap-legend");
  const legendMin = root.querySelector("[data-legend-min]");
  const legendMax = root.querySelector("[data-legend-max]");
  const gpuLink = root.dataset.gpuLink || "";
  const ctx = canvas.getContext("2d");
  const cells = document.createElement("canvas"); // one pixel per cell, scaled up on draw
  const cellCtx = cells.getContext("2d");

  let metric = select ? select.value : "util_pct";
  let rows = []; // {uuid, host, index, model}
  let rowOf = new Map();
  let columns = []; // {t: minute start (s), vals: Float32Array per row, NaN for none}
  let live = null; // the current minute: {t, sum: {metric: Float64Array}, n: {metric: Uint16Array}}
  let geometry = null;
  let dirty = true;
  let liveSamples = 0;
  let connection = { state: "connecting", hidden: false };

  function emptyLive(t) {
    const sum = {};
    const n = {};
    for (const k of Object.keys(METRICS)) { sum[k] = new Float64Array(rows.length); n[k] = new Uint16Array(rows.length); }
    return { t, sum, n };
  }

  function liveValue(row) {
    if (!live || !live.n[metric][row]) return NaN;
    return live.sum[metric][row] / live.n[metric][row];
  }

  function setRows(gpus) {
    rows = gpus.map((g) => ({ uuid: g.uuid, host: String(g.host || ""), index: g.index, model: g.model || "" }));
    rowOf = new Map(rows.map((r, i) => [r.uuid, i]));
    root.dataset.rows = String(rows.length);
  }

  function setHistory(body) {
    const t = Array.isArray(body.t) ? body.t : [];
    const gpus = Array.isArray(body.gpus) ? body.gpus.filter((g) => g && typeof g.uuid === "string") : [];
    const sameRows = gpus.length === rows.length && gpus.every((g, i) => g.uuid === rows[i].uuid);
    setRows(gpus);
    columns = t.map((minute, c) => ({
      t: minute,
      vals: Float32Array.from(gpus, (g) => (Array.isArray(g.values) && finite(g.values[c]) ? g.values[c] : NaN)),
    }));
    if (!sameRows) live = null; // rows moved: the live sums no longer line up
    dirty = true;
  }

  // A finished live minute becomes a history column (replacing that minute's rollup, which
  // the server may have stored before the minute was over).
  function roll(nextMinute) {
    if (live) {
      const vals = Float32Array.from(rows, (_, i) => liveValue(i));
      columns = columns.filter((c) => c.t !== live.t);
      columns.push({ t: live.t, vals });
      columns.sort((a, b) => a.t - b.t);
    }
    columns = columns.filter((c) => c.t > nextMinute - 60 * (SLOTS - 1) - 1);
    live = emptyLive(nextMinute);
  }

  function onSample(msg) {
    if (msg.type !== "gpu.sample" || !finite(msg.t) || msg.parent) return; // MIG devices aside
    const row = rowOf.get(msg.gpu);
    if (row === undefined) return;
    const minute = Math.floor(msg.t / 60000) * 60;
    if (!live || minute > live.t) roll(minute);
    for (const [k, m] of Object.entries(METRICS)) {
      const v = m.of(msg);
      if (finite(v)) { live.sum[k][row] += v; live.n[k][row] += 1; }
    }
    liveSamples += 1;
    root.dataset.liveSamples = String(liveSamples);
    dirty = true;
  }

  function range() {
    let max = 0;
    for (const c of columns) for (const v of c.vals) if (v > max) max = v;
    for (let i = 0; i < rows.length; i += 1) { const v = liveValue(i); if (v > max) max = v; }
    return METRICS[metric].range(max);
  }

  function drawLegend([lo, hi]) {
    const unit = METRICS[metric].unit;
    if (legendMin) legendMin.textContent = `${lo} ${unit}`;
    if (legendMax) legendMax.textContent = `${hi} ${unit}`;
    if (!legend) return;
    const lctx = legend.getContext("2d");
    const img = lctx.createImageData(256, 1);
    LUT.forEach((rgb, i) => img.data.set([...rgb, 255], i * 4));
    const strip = document.createElement("canvas");
    strip.width = 256; strip.height = 1;
    strip.getContext("2d").putImageData(img, 0, 0);
    lctx.imageSmoothingEnabled = true;
    lctx.drawImage(strip, 0, 0, legend.width, legend.height);
    legend.setAttribute("aria-label", `Colour scale: dark purple ${lo} ${unit}, yellow ${hi} ${unit}; grey: no data`);
  }

  function draw() {
    const started = performance.now();
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(480, canvas.parentElement.clientWidth);
    const rowH = rows.length ? Math.max(3, Math.min(20, Math.floor(640 / rows.length))) : 20;
    const gridH = Math.max(rowH, rows.length * rowH);
    const height = gridH + AXIS;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
      canvas.style.width = `${width}px`;
      canvas.style.height = `${height}px`;
    }
    const cellW = (width - GUTTER - 4) / SLOTS;
    // The live minute is the agents' (their sample times); before the first sample, ours.
    const now = live ? live.t : Math.floor(Date.now() / 60000) * 60;
    geometry = { rowH, cellW, now, gridH };
    const [lo, hi] = range();
    const span = hi - lo || 1;

    // One pixel per cell.
    const n = Math.max(1, rows.length);
    if (cells.width !== SLOTS || cells.height !== n) { cells.width = SLOTS; cells.height = n; }
    const img = cellCtx.createImageData(SLOTS, n);
    const px = img.data;
    const paint = (slot, row, v) => {
      const rgb = Number.isNaN(v) ? NO_DATA : LUT[Math.max(0, Math.min(255, Math.round(((v - lo) / span) * 255)))];
      const o = (row * SLOTS + slot) * 4;
      px[o] = rgb[0]; px[o + 1] = rgb[1]; px[o + 2] = rgb[2]; px[o + 3] = 255;
    };
    const filled = new Uint8Array(SLOTS);
    for (const c of columns) {
      const slot = SLOTS - 1 - Math.round((now - c.t) / 60);
      if (slot < 0 || slot >= SLOTS - 1) continue;
      filled[slot] = 1;
      for (let r = 0; r < rows.length; r += 1) paint(slot, r, c.vals[r]);
    }
    for (let slot = 0; slot < SLOTS - 1; slot += 1) if (!filled[slot]) for (let r = 0; r < rows.length; r += 1) paint(slot, r, NaN);
    for (let r = 0; r < rows.length; r += 1) paint(SLOTS - 1, r, liveValue(r));
    cellCtx.putImageData(img, 0, 0);

    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.imageSmoothingEnabled = false;
    if (rows.length) ctx.drawImage(cells, GUTTER, 0, cellW * SLOTS, gridH);

    // Row labels: every GPU when rows are tall enough to read, else each host once.
    ctx.fillStyle = "#1c2330";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    ctx.font = "12px system-ui, sans-serif";
    ctx.strokeStyle = "#ffffff";
    ctx.lineWidth = 1;
    let groupStart = 0;
    for (let r = 0; r <= rows.length; r += 1) {
      const newHost = r === rows.length || rows[r].host !== rows[groupStart].host;
      if (r < rows.length && rowH >= 12) ctx.fillText(`${rows[r].host}/gpu${rows[r].index}`, GUTTER - 8, r * rowH + rowH / 2);
      if (newHost && r > groupStart) {
        if (rowH < 12 && (r - groupStart) * rowH >= 9) {
          // Kept inside the grid's height, or a small first or last host's label is cut off.
          const y = Math.min(Math.max(((groupStart + r) / 2) * rowH, 7), gridH - 7);
          ctx.fillText(`${rows[groupStart].host} (${r - groupStart})`, GUTTER - 8, y);
        }
        if (r < rows.length) { // a white rule between hosts
          ctx.beginPath(); ctx.moveTo(GUTTER, r * rowH + 0.5); ctx.lineTo(GUTTER + cellW * SLOTS, r * rowH + 0.5); ctx.stroke();
        }
        groupStart = r;
      }
    }
    // The live column stands apart from the hour before it.
    ctx.lineWidth = 2;
    const liveX = GUTTER + cellW * (SLOTS - 1);
    ctx.beginPath(); ctx.moveTo(liveX, 0); ctx.lineTo(liveX, gridH); ctx.stroke();
    // Time axis: every 10 minutes, and the live minute.
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.fillStyle = "#4b5563";
    for (let slot = 0; slot < SLOTS - 1; slot += 10) {
      ctx.fillText(hhmm(now - (SLOTS - 1 - slot) * 60), GUTTER + cellW * (slot + 0.5), gridH + 6);
    }
    ctx.fillText("now", GUTTER + cellW * (SLOTS - 0.5), gridH + 6);

    drawLegend([lo, hi]);
    const m = METRICS[metric];
    canvas.setAttribute("aria-label", `Heatmap of ${m.label.toLowerCase()} for ${rows.length} GPUs, one column per minute ` +
      `of the last hour and the current minute last; ${lo} to ${hi} ${m.unit}. Hover a cell for its GPU, time and value.`);
    root.dataset.drawMs = (performance.now() - started).toFixed(2);
    root.dataset.draws = String(Number(root.dataset.draws || 0) + 1);
    dirty = false;
  }

  function cellAt(event) {
    if (!geometry || !rows.length) return null;
    const box = canvas.getBoundingClientRect();
    const x = event.clientX - box.left - GUTTER;
    const y = event.clientY - box.top;
    const slot = Math.floor(x / geometry.cellW);
    const row = Math.floor(y / geometry.rowH);
    if (x < 0 || slot >= SLOTS || row < 0 || row >= rows.length) return null;
    const t = geometry.now - (SLOTS - 1 - slot) * 60;
    let v = NaN;
    if (slot === SLOTS - 1) v = liveValue(row);
    else {
      const c = columns.find((col) => col.t === t);
      if (c) v = c.vals[row];
    }
    return { row, slot, t, v, x: event.clientX - box.left, y };
  }

  canvas.addEventListener("mousemove", (event) => {
    const cell = cellAt(event);
    if (!cell) { tip.hidden = true; return; }
    const g = rows[cell.row];
    const m = METRICS[metric];
    const value = Number.isNaN(cell.v) ? "no data" : `${cell.v.toFixed(metric === "power_w" ? 0 : 1)} ${m.unit}`;
    const when = cell.slot === SLOTS - 1 ? `${hhmm(cell.t)} (this minute, live)` : hhmm(cell.t);
    tip.textContent = `${g.host}/gpu${g.index}${g.model ? ` · ${g.model}` : ""} · ${when} · ${m.label}: ${value}`;
    tip.hidden = false;
    const left = Math.min(cell.x + 14, canvas.clientWidth - tip.offsetWidth - 4);
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${cell.y + 14}px`;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", (event) => {
    const cell = cellAt(event);
    if (cell && gpuLink) location.href = `${gpuLink}${encodeURIComponent(rows[cell.row].uuid)}/`;
  });

  function say() {
    if (!statusEl) return;
    const conn = describeStatus(connection, "the fleet's samples");
    statusEl.textContent = `${rows.length} GPUs · ${conn}`;
  }

  async function load() {
    const url = new URL(root.dataset.history, location.href);
    url.searchParams.set("metric", metric);
    try {
      setHistory(await getJson(url.toString()));
    } catch (err) {
      console.warn("no fleet history:", err);
    }
    say();
    draw();
  }

  // The page lists every GPU, so rows and the live column work before (or without) history.
  const listed = document.getElementById(root.dataset.gpus || "");
  if (listed) {
    try { setRows(JSON.parse(listed.textContent)); } catch { /* history will list them */ }
  }
  if (select) select.addEventListener("change", () => { metric = select.value; dirty = true; draw(); load(); });
  window.addEventListener("resize", () => { dirty = true; });
  const socket = liveSocket(root.dataset.ws);
  socket.onStatus((s) => { connection = s; say(); });
  socket.onMessage(onSample);

  // Visible: redraw each second when something changed; hidden: every 10 s.
  let timer = null;
  const schedule = () => {
    clearInterval(timer);
    timer = setInterval(() => { if (dirty) draw(); }, document.hidden ? 10000 : 1000);
  };
  document.addEventListener("visibilitychange", () => { schedule(); if (!document.hidden && dirty) draw(); });
  schedule();
  load();
}
