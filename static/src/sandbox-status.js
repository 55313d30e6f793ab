// The detail page's status part follows the sandbox's state changes, pushed on the socket its
// live chart already holds (portal/sandboxes/live.py), instead of polling every 2 s: with
// thousands of pages open that poll was most of the portal's requests. On a push the part is
// fetched once (htmx's "sandbox-changed" trigger on it); pushes that arrive together (a
// placement's placing, starting, running) are one fetch. A slow poll in the template catches
// what no push announces (a launch's progress, a warning, the time left).

import { liveSocket } from "./live.js";

const SETTLE_MS = 200;

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
}
