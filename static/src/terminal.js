// The web terminal: xterm.js in the page, a pty in the sandbox, relayed over a WebSocket
// (portal/sandboxes/consumers.py). Opened on demand: a click starts one shell session.
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import "@xterm/xterm/css/xterm.css";

export function mountTerminal(box) {
  const button = box.querySelector("[data-open-terminal]");
  const screen = box.querySelector(".terminal-screen");
  const status = box.querySelector(".terminal-status");
  if (!button || !screen) return;
  button.addEventListener("click", () => {
    button.disabled = true;
    screen.hidden = false;
    const term = new Terminal({ convertEol: false, cursorBlink: true, fontSize: 14, rows: 24 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(screen);
    fit.fit();
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${box.dataset.ws}`);
    ws.binaryType = "arraybuffer";
    const say = (text) => { if (status) status.textContent = text; };
    say("Connecting…");
    ws.onmessage = (event) => {
      if (typeof event.data !== "string") {
        term.write(new Uint8Array(event.data));
        return;
      }
      const msg = JSON.parse(event.data);
      if (msg.type === "opened") {
        say("Connected: this is a shell in the sandbox.");
        ws.send(JSON.stringify({ type: "resize", rows: term.rows, cols: term.cols }));
        term.focus();
      } else if (msg.type === "closed") {
        say(`Closed: ${msg.reason}`);
      }
    };
    ws.onclose = () => {
      button.disabled = false;
      button.textContent = "Open a new terminal";
    };
    term.onData((data) => {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "input", data }));
    });
    window.addEventListener("resize", () => {
      fit.fit();
      if (ws.readyState === WebSocket.OPEN) {
        ws.send(JSON.stringify({ type: "resize", rows: term.rows, cols: term.cols }));
      }
    });
  });
}
