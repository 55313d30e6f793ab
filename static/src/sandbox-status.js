// The detail page's status part follows the sandbox's state changes, pushed on the socket its
// live chart already holds (portal/sandboxes/live.py), instead of polling: with thousands of
// pages open the poll was most of the portal's requests. On a push (a state change, or any new
// line on its timeline: an extension, a preemption warning, a launch's progress) the part is
// fetched once (htmx's "sandbox-changed" trigger on it); pushes that arrive together (a
// placement's placing, starting, running) are one fetch. Between pushes the part's two moving
// figures move on here (tickFigures); a 5-minute poll in the template refreshes the rest (the
// GPU use the host last measured, which says when).

import { liveSocket } from "./live.js";

const SETTLE_MS = 200;
const TICK_MS = 1000;

export function followSandboxStatus(status) {
  let pending = null;
  const refresh = () => {
    if (pending) return;
    pending = setTimeout(() => {
      pending = null;
      window.htmx.trigger(status, "sandbox-changed");
    }, SETTLE_MS);
  };
  const socket = liveSocket(status.dataset.ws);
  socket.onMessage((msg) => {
    if (msg.type === "sandbox.changed" && String(msg.sandbox) === status.dataset.sandbox) refresh();
  });
  // A push sent before the socket joined its group (between this page's render and the
  // socket's open) or while it reconnected reached nobody: each open fetches the part once,
  // after SETTLE_MS, by when the server has joined the socket to the sandbox's group.
  let state = null;
  socket.onStatus((s) => {
    if (s.state === "open" && state !== "open") refresh();
    state = s.state;
  });
  tickFigures(status);
}

// The time left counts down, and the cost so far grows at the price of the placements still
// open (billing's figure is linear in time while they run: portal/billing/pricing.py), from
// the values the part was rendered with; each fetch of the part starts them again.
function tickFigures(status) {
  let renderedAt = performance.now();
  status.addEventListener("htmx:afterSwap", () => {
    renderedAt = performance.now();
  });
  setInterval(() => {
    const elapsedS = (performance.now() - renderedAt) / 1000;
    const left = status.querySelector("#time-left[data-seconds-left]");
    if (left && left.dataset.secondsLeft !== "") {
      left.textContent = timedeltaText(Math.max(0, Number(left.dataset.secondsLeft) - elapsedS));
    }
    const cost = status.querySelector("#sandbox-cost[data-cost-micros]");
    const perHour = cost ? Number(cost.dataset.perHourMicros) : 0;
    if (cost && perHour > 0) {
      const micros = Number(cost.dataset.costMicros) + (perHour * elapsedS) / 3600;
      cost.textContent = `${(micros / 1e6).toFixed(4)} ${cost.dataset.currency}`;
    }
  }, TICK_MS);
}

// As Python writes a timedelta of whole seconds (the server's rendering): "2 days, 3:04:05".
export function timedeltaText(totalSeconds) {
  const s = Math.floor(totalSeconds);
  const days = Math.floor(s / 86400);
  const rest = s % 86400;
  const pad = (n) => String(n).padStart(2, "0");
  const clock = `${Math.floor(rest / 3600)}:${pad(Math.floor((rest % 3600) / 60))}:${pad(rest % 60)}`;
  return days ? `${days} day${days === 1 ? "" : "s"}, ${clock}` : clock;
}
