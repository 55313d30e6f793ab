"""Screenshots of the operator's pages on a twin's database (docs/screenshots/twin-*.png).

Run after ``make twin`` with the same TWIN_DATABASE_URL and TWIN_REDIS_URL in
DATABASE_URL and REDIS_URL: it starts the portal on them (port 8765), signs in as an admin
it creates (``twin-admin``, a random password), and photographs the fleet console, a
filtered page of it and the heatmap with Debian's Chromium, printing each page's load time.

    DATABASE_URL=... REDIS_URL=... .venv/bin/python scripts/twin-screenshots.py
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
PORT = 8765
PAGES = [
    ("twin-fleet.png", "/console/fleet/", "section.card"),
    ("twin-fleet-filtered.png", "/console/fleet/?model=V100M32&gpu_state=available&page=3", "section.card"),
    ("twin-heatmap.png", "/console/heatmap/", "canvas.heatmap-grid"),
]


def main() -> int:
    password = secrets.token_urlsafe(16)
    env = {**os.environ, "DEBUG": "true", "SECRET_KEY": secrets.token_urlsafe(64)}
    make_admin = (
        "from django.contrib.auth import get_user_model as g; U = g(); "
        "u, _ = U.objects.get_or_create(username='twin-admin'); "
        f"u.is_staff = u.is_superuser = True; u.set_password('{password}'); u.save()"
    )
    subprocess.run([sys.executable, "manage.py", "shell", "-c", make_admin], cwd=ROOT, env=env, check=True)  # noqa: S603
    uvicorn = ["-m", "uvicorn", "portal.asgi:application", "--port", f"{PORT}", "--log-level", "warning"]
    server = subprocess.Popen([sys.executable, *uvicorn], cwd=ROOT, env=env)  # noqa: S603 - our own argv
    base = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=1)  # noqa: S310 - our own server
                break
            except OSError:
                time.sleep(0.3)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/login/?next=/console/fleet/")
            page.fill("input[name=username]", "twin-admin")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/console/fleet/")
            for name, path, ready in PAGES:
                began = time.perf_counter()
                page.goto(f"{base}{path}")
                page.wait_for_selector(ready)
                page.wait_for_timeout(3000)  # the live samples, the heatmap's history
                print(f"{path}: loaded in {time.perf_counter() - began - 3:.2f} s -> {name}")
                page.screenshot(path=str(OUT / name))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
