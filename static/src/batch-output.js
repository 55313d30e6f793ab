// A batch's output on its page: the tail the server rendered, then every piece the agent
// streams on the sandbox's socket ("sandbox.output"). A piece that does not follow on from
// what is shown (the socket dropped some, or the page opened mid-stream) is fetched from the
// API from where the page stands. The API reads the control plane's copy, which lags the
// agent's socket: a fetch that comes back short of what the socket announced is tried again,
// and once the run has ended the page reads until the API says the output is complete (the
// last lines are shipped to the control plane at the stop, not on the socket).
// Output is text: it goes into the <pre> as text, never HTML.
import { liveSocket } from "./live.js";

const KEEP_CHARS = 256 * 1024; // the page keeps the last quarter-MiB; the download has all
const RETRY_MS = 1000;
const MAX_FRUITLESS = 30; // fetches in a row that bring nothing new before the page gives up

// Sizes as the server's template writes them (Django's filesizeformat: 1024 a step).
function size(bytes) {
  const units = ["bytes", "KB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit ? `${value.toFixed(1)} ${units[unit]}` : `${value} bytes`;
}

export function mountBatchOutput(card) {
  const pre = card.querySelector("pre.output");
  const status = card.querySelector(".output-status");
  const summary = card.querySelector(".output-summary");
  const download = card.querySelector(".output-download");
  const api = card.dataset.api;
  let end = Number(card.dataset.end) || 0; // offset just past what the page shows
  let announced = end; // the furthest offset a socket piece reached
  let ended = false; // the run is over: read until the API says complete
  let fetching = null;
  let retry = null;
  let fruitless = 0;
  pre.scrollTop = pre.scrollHeight; // the tail is what matters: start at the newest line

  function append(text, dropped, newEnd) {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    let shown = pre.textContent + (dropped > 0 ? `\n[… ${dropped} bytes not kept …]\n` : "") + text;
    if (shown.length > KEEP_CHARS) shown = shown.slice(shown.length - KEEP_CHARS);
    pre.textContent = shown;
    if (atBottom) pre.scrollTop = pre.scrollHeight;
    // The facts line was the server's when the page loaded ("Nothing printed yet."): keep it true.
    if (summary) summary.textContent = `${size(newEnd)} printed so far; showing the last ${size(shown.length)}.`;
    if (download) download.hidden = false;
  }

  // Whether the page still lacks output the API will have: announced on the socket, or (the
  // run over) anything until the API says complete.
  function behind(body) {
    if (announced > end) return true;
    return ended && !(body && body.complete && body.end >= body.total);
  }

  // Fetch from where the page stands; while the page is behind, ask again every RETRY_MS
  // (giving up after MAX_FRUITLESS answers in a row that brought nothing).
  function catchUp() {
    if (fetching) return;
    fetching = (async () => {
      let body = null;
      try {
        const answer = await fetch(`${api}?offset=${end}`, { credentials: "same-origin" });
        if (answer.ok) body = await answer.json();
        if (body && (typeof body.text !== "string" || typeof body.end !== "number")) body = null;
      } catch (err) {
        body = null;
      }
      fetching = null;
      if (body && body.end > end) {
        append(body.text, Math.max(0, body.start - end) + (body.missing || 0), body.end);
        end = body.end;
        fruitless = 0;
      } else {
        fruitless += 1;
      }
      if (!behind(body)) {
        if (ended && status) status.textContent = "The run has ended.";
      } else if (!retry && fruitless < MAX_FRUITLESS) {
        retry = setTimeout(() => { retry = null; catchUp(); }, RETRY_MS);
      }
    })();
  }

  if (!card.dataset.ws) return; // an ended run: what the server rendered is all there is
  const stateBox = document.getElementById("status"); // htmx polls the state into it
  if (stateBox) {
    const watcher = new MutationObserver(() => {
      const state = document.getElementById("sandbox-state");
      if (state && state.hasAttribute("data-ended")) {
        watcher.disconnect();
        ended = true;
        fruitless = 0;
        catchUp();
      }
    });
    watcher.observe(stateBox, { childList: true, subtree: true });
  }
  liveSocket(card.dataset.ws).onMessage((msg) => {
    if (msg.type !== "sandbox.output" || String(msg.sandbox) !== card.dataset.sandbox) return;
    if (typeof msg.text !== "string" || typeof msg.start !== "number" || typeof msg.end !== "number") return;
    const pieceEnd = msg.end;
    announced = Math.max(announced, pieceEnd);
    if (pieceEnd <= end) return; // shown already
    const follows = msg.start === end || (msg.dropped > 0 && msg.start - msg.dropped === end);
    if (fetching || !follows) {
      catchUp(); // a gap or an overlap (the socket dropped some, or a fetch is on its way): read from the API
      return;
    }
    append(msg.text, msg.dropped || 0, pieceEnd);
    end = pieceEnd;
    if (status) status.textContent = "Live.";
  });
}
