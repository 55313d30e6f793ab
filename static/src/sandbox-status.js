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
  liveSocket(status.dataset.ws).onMessage((msg) => {
    if (msg.type !== "sandbox.changed" || String(msg.sandbox) !== status.dataset.sandbox) return;
    if (pending) return;
    pending = setTimeout(() => {
      pending = null;
      window.htmx.trigger(status, "sandbox-changed");
    }, SETTLE_MS);
  });
}
