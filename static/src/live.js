// One WebSocket per stream URL, shared by every widget on the page that reads it (the fleet
// console's live cells and its alerts panel read the same /ws/fleet/), so a page never holds
// two connections to one group.
//
// Reconnects with exponential backoff and jitter: after a server restart every open tab
// would otherwise come back in the same second. While the tab is hidden it asks the server
// for at most one sample per GPU every HIDDEN_INTERVAL_MS (the server coalesces to the
// newest), and asks for everything again when the tab is shown.

const FIRST_DELAY_MS = 1000;
const MAX_DELAY_MS = 30000;
const STABLE_MS = 5000; // a connection that lived this long resets the backoff
export const HIDDEN_INTERVAL_MS = 10000;
export const FORBIDDEN = 4403; // portal/telemetry/consumers.py: permission refused

const sockets = new Map();

export function liveSocket(path) {
  if (!sockets.has(path)) sockets.set(path, new LiveSocket(path));
  return sockets.get(path);
}

class LiveSocket {
  constructor(path) {
    this.path = path;
    this.listeners = new Set();
    this.statusListeners = new Set();
    this.delay = FIRST_DELAY_MS;
    this.status = { state: "connecting", hidden: document.hidden, retryInMs: 0 };
    this.ws = null;
    document.addEventListener("visibilitychange", () => {
      this.sendInterval();
      this.setStatus({ hidden: document.hidden });
    });
    // Widgets subscribe in the same task that created the socket; connecting on the next
    // one means none of them misses the first message or the first status.
    setTimeout(() => this.connect(), 0);
  }

  onMessage(fn) { this.listeners.add(fn); }

  onStatus(fn) {
    this.statusListeners.add(fn);
    fn(this.status);
  }

  setStatus(change) {
    this.status = { ...this.status, ...change };
    for (const fn of this.statusListeners) fn(this.status);
  }

  sendInterval() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ action: "interval", ms: document.hidden ? HIDDEN_INTERVAL_MS : 0 }));
    }
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${this.path}`);
    this.ws = ws;
    let openedAt = 0;
    this.setStatus({ state: "connecting", retryInMs: 0 });
    ws.onopen = () => {
      openedAt = Date.now();
      this.setStatus({ state: "open" });
      if (document.hidden) this.sendInterval();
    };
    ws.onmessage = (event) => {
      let msg;
      try { msg = JSON.parse(event.data); } catch { return; }
      if (!msg || typeof msg !== "object" || typeof msg.type !== "string") return;
      // The fleet stream sends each host's samples of a tick as one message; widgets see
      // them one GPU at a time, as on every other stream.
      const each = msg.type === "fleet.samples" && Array.isArray(msg.samples) ? msg.samples : [msg];
      for (const one of each) {
        if (!one || typeof one !== "object") continue;
        for (const fn of this.listeners) {
          try { fn(one); } catch (err) { console.error(err); } // one widget's bug spares the rest
        }
      }
    };
    ws.onclose = (event) => {
      if (event.code === FORBIDDEN) {
        this.setStatus({ state: "refused" }); // retrying would not help
        return;
      }
      // A server that accepts and drops at once must not be retried every second.
      if (openedAt && Date.now() - openedAt > STABLE_MS) this.delay = FIRST_DELAY_MS;
      const wait = this.delay / 2 + Math.random() * (this.delay / 2);
      this.delay = Math.min(this.delay * 2, MAX_DELAY_MS);
      this.setStatus({ state: "retrying", retryInMs: wait });
      setTimeout(() => this.connect(), wait);
    };
  }
}

// A sentence for a status line; `what` names the stream ("this sandbox's GPU").
export function describeStatus(status, what) {
  const slow = status.hidden ? ` Tab hidden: one update every ${HIDDEN_INTERVAL_MS / 1000} s.` : "";
  switch (status.state) {
    case "open": return `Live: connected to ${what}.${slow}`;
    case "retrying": return `Disconnected from ${what}; reconnecting in ${Math.ceil(status.retryInMs / 1000)} s.`;
    case "refused": return `You may not watch ${what}.`;
    default: return `Connecting to ${what}…`;
  }
}
