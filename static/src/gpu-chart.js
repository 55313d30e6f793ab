// Live GPU charts (uPlot) for a sandbox page or an admin's GPU page: the last hour from the
// one-minute rollups (mean line, min–max band), then every live sample appended as it comes.
// Samples are validated before plotting; the socket (live.js) reconnects with backoff and
// slows down while the tab is hidden, and the charts then redraw less often too.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { liveSocket, describeStatus } from "./live.js";

const HISTORY_MINUTES = 60;
const DEVICE_FRESH_MS = 5000; // a sandbox device silent this long no longer counts
const NUMBER_FIELDS = ["t", "temp_c", "mem_used_mib", "mem_total_mib", "power_w"];
const COLORS = { temp: "#c2410c", util: "#2457d6", mem: "#7c3aed", power: "#15803d", cost: "#0f766e" };

// util_pct may be null: the device's utilization is not measured (a MIG device without
// GPM). That is shown as "—" and drawn as a gap, never as 0 (idle).
export function validSample(msg) {
  if (!msg || msg.type !== "gpu.sample" || typeof msg.gpu !== "string") return false;
  return NUMBER_FIELDS.every((k) => finite(msg[k])) && (msg.util_pct === null || finite(msg.util_pct));
}

const finite = (v) => typeof v === "number" && Number.isFinite(v);
export const pctText = (v) => (finite(v) ? `${v.toFixed(0)} %` : "utilization —");

export async function getJson(url) {
  const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

export function moneyFormat(currency) {
  const make = (digits) => {
    try {
      return new Intl.NumberFormat(undefined, { style: "currency", currency, minimumFractionDigits: digits, maximumFractionDigits: digits });
    } catch { // an unknown currency code: plain number and code
      return { format: (v) => `${v.toFixed(digits)} ${currency}` };
    }
  };
  const fine = make(4);
  const coarse = make(2);
  // The first minutes of a sandbox cost fractions of a cent: show them rather than 0.00.
  return (v) => (v == null ? "—" : (Math.abs(v) < 1 ? fine : coarse).format(v));
}

// One chart's points: the history minutes first, then the live samples after them. The
// history band (min and max per minute) is kept beside, for the band drawing.
class Track {
  constructor(keys) {
    this.keys = keys;
    this.hx = []; this.lx = [];
    this.h = {}; this.lo = {}; this.hi = {}; this.l = {};
    for (const k of keys) { this.h[k] = []; this.l[k] = []; }
    this.histCount = 0;
  }

  setHistory(x, cols) {
    this.hx = x;
    for (const k of this.keys) {
      const col = cols[k] || {};
      this.h[k] = col.mean || x.map(() => null);
      this.lo[k] = col.min || null;
      this.hi[k] = col.max || null;
    }
  }

  push(x, values) {
    const last = this.lx[this.lx.length - 1];
    if (last !== undefined && x <= last) return; // uPlot needs x ascending
    this.lx.push(x);
    for (const k of this.keys) this.l[k].push(finite(values[k]) ? values[k] : null);
    const oldest = x - HISTORY_MINUTES * 60;
    let drop = 0;
    while (drop < this.lx.length && this.lx[drop] < oldest) drop += 1;
    if (drop) {
      this.lx.splice(0, drop);
      for (const k of this.keys) this.l[k].splice(0, drop);
    }
  }

  compose() {
    // History minutes that the live samples already cover are left out, and with them
    // the last hour's start slides forward as live samples come.
    const cut = this.lx.length ? this.lx[0] : Infinity;
    const floor = this.lx.length ? this.lx[this.lx.length - 1] - HISTORY_MINUTES * 60 : -Infinity;
    let start = 0;
    while (start < this.hx.length && this.hx[start] < floor) start += 1;
    let end = start;
    while (end < this.hx.length && this.hx[end] < cut) end += 1;
    this.histStart = start;
    this.histEnd = end;
    return [
      this.hx.slice(start, end).concat(this.lx),
      ...this.keys.map((k) => this.h[k].slice(start, end).concat(this.l[k])),
    ];
  }
}

// Fills the min–max band of each history minute under the mean lines.
function bandPlugin(track, bands) {
  const draw = (u) => {
    const { ctx } = u;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    for (const { key, scale, fill } of bands) {
      const lo = track.lo[key];
      const hi = track.hi[key];
      if (!lo || !hi) continue;
      ctx.fillStyle = fill;
      let run = [];
      const flush = () => {
        if (run.length > 1) {
          ctx.beginPath();
          run.forEach(([x, , h], i) => (i ? ctx.lineTo(x, h) : ctx.moveTo(x, h)));
          for (let i = run.length - 1; i >= 0; i -= 1) ctx.lineTo(run[i][0], run[i][1]);
          ctx.closePath();
          ctx.fill();
        }
        run = [];
      };
      for (let i = track.histStart; i < track.histEnd; i += 1) {
        if (!finite(lo[i]) || !finite(hi[i])) { flush(); continue; }
        const x = u.valToPos(track.hx[i], "x", true);
        run.push([x, u.valToPos(lo[i], scale, true), u.valToPos(hi[i], scale, true)]);
      }
      flush();
    }
    ctx.restore();
  };
  return { hooks: { drawAxes: [draw] } };
}

const MIN_SPAN_S = 300;

function timeRange(u, min, max) {
  // uPlot widens a lone point's x range by a day of its unit (86,400 s here at ms = 1e-3
  // seconds: 1,000 days), so a span is no sign of it: the data is.
  const xs = (u.data && u.data[0]) || [];
  if (xs.length === 1 && finite(xs[0])) return [xs[0] - MIN_SPAN_S, xs[0]];
  if (!finite(min) || !finite(max)) {
    const now = Date.now() / 1000;
    return [now - MIN_SPAN_S, now];
  }
  return max - min < MIN_SPAN_S ? [max - MIN_SPAN_S, max] : [min, max];
}

function makeChart(el, spec, track, width) {
  const axes = [{}];
  // At least five minutes across: uPlot spreads a lone point (a short sandbox's one rollup)
  // over years of axis otherwise.
  const scales = { x: { time: true, range: timeRange } };
  spec.axes.forEach((a, i) => {
    axes.push({ scale: a.scale, label: a.label, side: i ? 1 : 3, grid: { show: i === 0 }, size: 56 });
    scales[a.scale] = { range: a.range };
  });
  // Away from the cursor the legend shows the newest values rather than blanks.
  const newest = (u, v, si, idx) => {
    if (idx != null) return v;
    const col = u.data[si] || [];
    for (let i = col.length - 1; i >= 0; i -= 1) if (col[i] != null) return col[i];
    return null;
  };
  const clock = (u, v, si, idx) => {
    const t = newest(u, v, si, idx);
    return t == null ? "—" : new Date(t * 1000).toLocaleTimeString();
  };
  const series = [{ label: "Time", value: clock }, ...spec.series.map((s) => ({
    label: s.label, scale: s.scale, stroke: COLORS[s.key], width: 2, spanGaps: true, points: { show: false },
    value: (u, v, si, idx) => { const w = newest(u, v, si, idx); return w == null ? "—" : s.fmt(w); },
  }))];
  const bands = spec.series.filter((s) => s.band).map((s) => ({ key: s.key, scale: s.scale, fill: `${COLORS[s.key]}26` }));
  const opts = { title: spec.title || undefined, width, height: 240, scales, series, axes, plugins: [bandPlugin(track, bands)] };
  return new uPlot(opts, [[], ...spec.series.map(() => [])], el);
}

const pct = (v) => `${v.toFixed(0)} %`;
const gib = (v) => `${v.toFixed(1)} GiB`;

function chartSpecs(kind, currency, memTotal) {
  const money = moneyFormat(currency);
  const memRange = (u, min, max) => [0, Math.max(1, memTotal.gib || 0, (max || 0) * 1.1)];
  const powerRange = (u, min, max) => [0, Math.max(100, (max || 0) * 1.2)];
  const ours = kind === "sandbox";
  return {
    heat: {
      title: "Temperature and utilization",
      axes: [{ scale: "pct", label: "°C · %", range: [0, 100] }],
      series: [
        { key: "temp", label: ours ? "Temperature °C (minute max)" : "Temperature °C", scale: "pct", band: !ours, fmt: (v) => `${v.toFixed(0)} °C` },
        { key: "util", label: "Utilization %", scale: "pct", band: true, fmt: pct },
      ],
    },
    load: {
      title: "Memory and power",
      axes: [{ scale: "gib", label: "GiB", range: memRange }, { scale: "w", label: "W", range: powerRange }],
      series: [
        { key: "mem", label: ours ? "Memory used by this sandbox" : "Memory used", scale: "gib", band: true, fmt: gib },
        { key: "power", label: "Power W", scale: "w", band: !ours, fmt: (v) => `${v.toFixed(0)} W` },
      ],
    },
    cost: {
      title: "", // its card says what it is
      axes: [{ scale: "money", label: currency, range: (u, min, max) => [0, Math.max(0.01, (max || 0) * 1.15)] }],
      series: [{ key: "cost", label: "Cost so far", scale: "money", fmt: money }],
    },
  };
}

// A history column (an array, or {min, mean, max} of arrays) scaled, as n values each.
function column(n, values, scale = 1) {
  const arr = (a) => (Array.isArray(a) && a.length === n ? a.map((v) => (finite(v) ? v / scale : null)) : null);
  if (Array.isArray(values)) return { mean: arr(values) || new Array(n).fill(null) };
  const col = values || {};
  return { mean: arr(col.mean) || new Array(n).fill(null), min: arr(col.min), max: arr(col.max) };
}

// The history endpoints' JSON, as tracks: a minute's figures sit at its middle, except the
// cost, which is the running cost at the minute's end.
function applyHistory(kind, body, tracks, memTotal) {
  const t = Array.isArray(body.t) ? body.t : [];
  const mid = t.map((s) => s + 30);
  const n = t.length;
  if (kind === "gpu") {
    if (finite(body.mem_total_mib)) memTotal.gib = body.mem_total_mib / 1024;
    tracks.heat.setHistory(mid, { temp: column(n, body.temp_c), util: column(n, body.util_pct) });
    tracks.load.setHistory(mid, { mem: column(n, body.mem_used_mib, 1024), power: column(n, body.power_w) });
  } else {
    tracks.heat.setHistory(mid, { temp: column(n, body.temp_max_c), util: column(n, body.util_pct) });
    tracks.load.setHistory(mid, { mem: column(n, body.mem_mib, 1024), power: column(n, body.power_mean_w) });
    tracks.cost.setHistory(t.map((s) => s + 60), { cost: column(n, body.cost_micros, 1e6) });
  }
}

// A sandbox with several devices gets one sample per device per tick: its point combines the
// newest sample of each (hottest temperature, mean utilization, summed memory and power). Its
// cost so far is the portal's (billing's figure, added to the sandbox stream's samples; the
// GPU hosts compute none): a sample without one still plots, with no cost point.
function sandboxFigures(sandboxId, devices, msg) {
  const own = msg.sandboxes && msg.sandboxes[sandboxId];
  if (!own || !finite(own.mem_mib) || !(own.util_pct === null || finite(own.util_pct))) {
    return null;
  }
  devices.set(msg.gpu, { msg, own });
  const fresh = [...devices.values()].filter((d) => d.msg.t > msg.t - DEVICE_FRESH_MS);
  const sum = (f) => fresh.reduce((acc, d) => acc + f(d), 0);
  const measured = fresh.filter((d) => finite(d.own.util_pct)); // unmeasured devices aside
  const costs = fresh.map((d) => d.own.cost_micros).filter(finite);
  return {
    devices: fresh.length,
    temp: Math.max(...fresh.map((d) => d.msg.temp_c)),
    util: measured.length ? measured.reduce((acc, d) => acc + d.own.util_pct, 0) / measured.length : null,
    mem: sum((d) => d.own.mem_mib) / 1024,
    memTotal: sum((d) => d.msg.mem_total_mib) / 1024,
    power: sum((d) => d.msg.power_w),
    cost: costs.length ? Math.max(...costs) / 1e6 : null,
  };
}

function statusLine(el) {
  if (!el) return { conn: () => {}, figures: () => {} };
  el.textContent = "";
  const conn = document.createElement("span");
  conn.setAttribute("role", "status"); // announced when the connection changes, not per sample
  const figures = document.createElement("span");
  figures.className = "figures";
  el.append(conn, " ", figures);
  return { conn: (text) => { conn.textContent = text; }, figures: (text) => { figures.textContent = text; } };
}

export function mountGpuCharts(root) {
  const sandboxId = root.dataset.sandbox || "";
  const kind = sandboxId ? "sandbox" : "gpu";
  const gpuUuid = root.dataset.gpu || "";
  const currency = root.dataset.currency || "EUR";
  const money = moneyFormat(currency);
  const memTotal = { gib: 0 };
  const specs = chartSpecs(kind, currency, memTotal);
  const costRoot = root.dataset.costChart ? document.getElementById(root.dataset.costChart) : null;
  const tracks = {
    heat: new Track(["temp", "util"]),
    load: new Track(["mem", "power"]),
    cost: new Track(["cost"]),
  };

  root.classList.add("chart-pair");
  const boxes = { heat: document.createElement("div"), load: document.createElement("div") };
  root.append(boxes.heat, boxes.load);
  if (costRoot) {
    boxes.cost = document.createElement("div");
    costRoot.append(boxes.cost);
  }
  const widthOf = (box) => Math.max(300, Math.floor(box.clientWidth || root.clientWidth / 2));
  const charts = {};
  for (const name of Object.keys(boxes)) charts[name] = makeChart(boxes[name], specs[name], tracks[name], widthOf(boxes[name]));
  window.addEventListener("resize", () => {
    for (const name of Object.keys(charts)) charts[name].setSize({ width: widthOf(boxes[name]), height: 240 });
  });

  // An ended sandbox's page has no stream (data-ws): its status line stays the server's.
  const live = Boolean(root.dataset.ws);
  const status = statusLine(live ? document.getElementById("chart-status") : null);
  const what = kind === "sandbox" ? "this sandbox's GPU" : "this GPU";
  let samples = 0;
  let dirty = false;
  const devices = new Map();

  function push(msg) {
    const x = msg.t / 1000;
    let v;
    if (kind === "sandbox") {
      v = sandboxFigures(sandboxId, devices, msg);
      if (!v) return;
      tracks.cost.push(x, { cost: v.cost });
    } else {
      if (gpuUuid && msg.gpu !== gpuUuid) return;
      v = { temp: msg.temp_c, util: msg.util_pct, mem: msg.mem_used_mib / 1024, memTotal: msg.mem_total_mib / 1024, power: msg.power_w };
    }
    memTotal.gib = v.memTotal;
    tracks.heat.push(x, v);
    tracks.load.push(x, v);
    samples += 1;
    dirty = true;
    root.dataset.samples = String(samples);
    const sim = msg.simulated ? " (simulated GPU: modelled figures, not a real device)" : "";
    const several = v.devices > 1 ? ` and ${v.devices - 1} more` : "";
    const throttled = Array.isArray(msg.throttle) && msg.throttle.length ? ` · throttled: ${msg.throttle.join(", ")}` : "";
    const cost = kind === "sandbox" && v.cost !== null ? ` · ${money(v.cost)} so far` : "";
    status.figures(`${msg.gpu}${several} on ${msg.host || "its host"}${sim} · ${v.temp.toFixed(0)} °C · ` +
      `${pctText(v.util)} · ${v.mem.toFixed(1)} / ${v.memTotal.toFixed(0)} GiB · ${v.power.toFixed(0)} W${cost}${throttled}`);
  }

  function redraw() {
    if (!dirty) return;
    dirty = false;
    for (const name of Object.keys(charts)) charts[name].setData(tracks[name].compose());
    root.dataset.points = String(charts.heat.data[0].length);
  }
  // Visible: redraw every second; hidden: every 10 s (samples still come, fewer of them).
  let timer = setInterval(redraw, 1000);
  document.addEventListener("visibilitychange", () => {
    clearInterval(timer);
    timer = setInterval(redraw, document.hidden ? 10000 : 1000);
    if (!document.hidden) redraw();
  });

  if (live) {
    const socket = liveSocket(root.dataset.ws);
    socket.onStatus((s) => status.conn(describeStatus(s, what)));
    socket.onMessage((msg) => { if (validSample(msg)) push(msg); });
  }

  if (root.dataset.history) {
    getJson(root.dataset.history).then((body) => {
      applyHistory(kind, body, tracks, memTotal);
      root.dataset.historyMinutes = String(tracks.heat.hx.length);
      const note = document.getElementById("chart-status");
      if (!live && note && !tracks.heat.hx.length) note.textContent += " No minute of its figures was kept (a run shorter than a one-minute rollup leaves none).";
      dirty = true;
      redraw();
    }).catch((err) => {
      root.dataset.historyMinutes = "0";
      console.warn("no history:", err);
    });
  }
}
