"""``make run`` as a test starts it: ``python -m portal.launcher`` in a process group of its
own, with its own var dir and port, and the newcomer's environment (none of the test run's
servers or settings) unless ``servers`` names a database and Redis for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.platform import free_port

ROOT = Path(__file__).resolve().parents[2]


class Launcher:
    def __init__(
        self, var_dir: Path, log: Path, driver: str = "process", servers: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.log = log
        self.env = {
            key: value
            for key, value in os.environ.items()
            # The newcomer's environment: none of the test run's servers or settings.
            if key not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS", "DEBUG", "LOG_LEVEL"}
            and not key.startswith(("SECURE_", "SESSION_", "CSRF_", "STATIC_"))
        }
        self.env |= {"GPUSHARE_VAR_DIR": str(var_dir), "PORT": str(self.port), "SANDBOX_DRIVER": driver}
        self.env |= servers or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "portal.launcher"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def healthz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as answer:
                return dict(json.loads(answer.read()))
        except OSError:
            return None

    def manage(self, code: str, stdin: str = "") -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=ROOT, env={**self.env, "DEBUG": "true"}, input=stdin, capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    def post(self, path: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A POST that must succeed (an error status raises HTTPError)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=120) as answer:  # noqa: S310
            return answer.status, dict(json.loads(answer.read()))

    def answer(self, path: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
        """A POST's status and body, an error's too."""
        try:
            return self.post(path, key, body)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's group
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
