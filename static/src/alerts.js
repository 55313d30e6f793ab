// An alerts panel kept live: the open alerts and the recently cleared ones from the alerts
// endpoint, then `alert.changed` messages from the page's stream (raised: added to the open
// list; cleared: moved to the recent list). The stream is shared with the page's charts.
import { liveSocket } from "./live.js";
import { getJson } from "./gpu-chart.js";

const KINDS = {
  temperature: "Temperature",
  throttle: "Throttling",
  xid: "XID error",
  utilization: "Utilization held high",
  memory: "Memory nearly full",
};
const RECENT = 20;

export function validAlert(msg) {
  return Boolean(msg) && msg.type === "alert.changed" && typeof msg.key === "string" && msg.key !== "" &&
    (msg.state === "raised" || msg.state === "cleared") && typeof msg.message === "string";
}

const when = (iso) => {
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? "" : d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
};

export function mountAlerts(panel) {
  const openList = panel.querySelector("[data-alerts-open]");
  const recentList = panel.querySelector("[data-alerts-recent]");
  const status = panel.querySelector("[data-alerts-status]");
  const gpuLink = panel.dataset.gpuLink || ""; // e.g. /console/gpus/ for admins
  const open = new Map(); // key -> alert, newest first when drawn
  let recent = [];

  function item(alert) {
    const li = document.createElement("li");
    li.className = `alert alert-${alert.kind || "other"}`;
    li.dataset.key = alert.key;
    const kind = document.createElement("strong");
    kind.textContent = KINDS[alert.kind] || alert.kind || "Alert";
    li.append(kind, " ");
    if (alert.host || alert.gpu) {
      const where = alert.host || alert.gpu;
      if (gpuLink && alert.gpu) {
        const a = document.createElement("a");
        a.href = `${gpuLink}${encodeURIComponent(alert.gpu)}/`;
        a.textContent = where;
        a.title = alert.gpu;
        li.append(a, " · ");
      } else {
        li.append(`${where} · `);
      }
    }
    if (alert.sandbox) li.append(`sandbox ${alert.sandbox} · `);
    li.append(alert.message);
    const time = document.createElement("time");
    const at = alert.cleared_at || alert.raised_at;
    time.dateTime = at || "";
    time.className = "muted small";
    time.textContent = alert.cleared_at ? ` cleared ${when(alert.cleared_at)}` : ` since ${when(alert.raised_at)}`;
    li.append(time);
    return li;
  }

  function draw() {
    // Newest first; times from the endpoint and from live messages differ in format, not meaning.
    const openAlerts = [...open.values()].sort((a, b) => (Date.parse(b.raised_at) || 0) - (Date.parse(a.raised_at) || 0));
    openList.replaceChildren(...openAlerts.map(item));
    if (!openAlerts.length) {
      const none = document.createElement("li");
      none.className = "muted none";
      none.textContent = "No open alerts.";
      openList.append(none);
    }
    recentList.replaceChildren(...recent.map(item));
    if (!recent.length) {
      const none = document.createElement("li");
      none.className = "muted none";
      none.textContent = "None cleared lately.";
      recentList.append(none);
    }
    panel.dataset.open = String(openAlerts.length);
    panel.classList.toggle("has-open", openAlerts.length > 0);
  }

  function apply(msg) {
    const at = new Date(finiteOr(msg.t, Date.now())).toISOString();
    const alert = {
      key: msg.key, kind: msg.kind, state: msg.state, message: msg.message, value: msg.value,
      threshold: msg.threshold, gpu: msg.gpu, host: msg.host, sandbox: msg.sandbox ?? null,
    };
    if (msg.state === "raised") {
      open.set(msg.key, { ...alert, raised_at: at, cleared_at: null });
      recent = recent.filter((a) => a.key !== msg.key);
    } else {
      const was = open.get(msg.key);
      open.delete(msg.key);
      recent = [{ ...(was || alert), ...alert, raised_at: was ? was.raised_at : at, cleared_at: at },
        ...recent.filter((a) => a.key !== msg.key)].slice(0, RECENT);
    }
    draw();
  }

  // Live messages that arrive before the list has loaded are replayed over it.
  let pending = [];
  liveSocket(panel.dataset.ws).onMessage((msg) => {
    if (!validAlert(msg)) return;
    if (pending) pending.push(msg); else apply(msg);
  });
  getJson(panel.dataset.alerts).then((body) => {
    for (const a of body.alerts || []) {
      if (!a || typeof a.key !== "string") continue;
      if (a.cleared_at) recent.push(a); else open.set(a.key, a);
    }
    recent = recent.slice(0, RECENT);
    if (status) status.textContent = "";
  }).catch(() => {
    if (status) status.textContent = "The alert list could not be loaded; new alerts still show here.";
  }).finally(() => {
    const replay = pending;
    pending = null;
    draw();
    replay.forEach(apply);
  });
}

function finiteOr(v, fallback) {
  return typeof v === "number" && Number.isFinite(v) ? v : fallback;
}
