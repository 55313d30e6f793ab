"""``make run``: the whole platform in one command, for a laptop or a demo.

Migrates, seeds the demo, then runs the ASGI server, a control worker, one host agent per
simulated demo host and celery beat, prefixing their output. Ctrl-C (or SIGTERM) stops
them all cleanly, then the embedded Redis. Production runs these as separate services.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from portal.demo import DEMO_HOSTS, DEMO_USERS
from workers import config

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _celery(*args: str) -> list[str]:
    return [PY, "-m", "celery", "-A", "workers", *args, "--loglevel=INFO"]


SANDBOX_IMAGE = "gpushare/sandbox-base:1"


def choose_driver() -> tuple[str, str]:
    """The agents' sandbox driver, and a line for the operator when it is not Docker."""
    kind = config.sandbox_driver_kind()
    if kind != "auto":
        return kind, ""
    from workers.drivers.docker import docker_available

    if not docker_available():
        return "process", "no Docker engine reachable: sandboxes run as bubblewrap processes"
    import docker

    try:
        docker.from_env().images.get(SANDBOX_IMAGE)
    except docker.errors.ImageNotFound:
        print(f"gpushare: building the sandbox image {SANDBOX_IMAGE} (once)…", flush=True)
        built = subprocess.run(["bash", str(ROOT / "scripts" / "build-sandbox-image.sh")], check=False)  # noqa: S603, S607
        if built.returncode != 0:
            return "process", f"could not build {SANDBOX_IMAGE}: sandboxes run as bubblewrap processes"
    return "docker", ""


def commands(port: int, host: str, driver: str) -> list[tuple[str, list[str], dict[str, str]]]:
    var = config.var_dir()
    procs: list[tuple[str, list[str], dict[str, str]]] = [
        (
            "web",
            [
                PY,
                "-m",
                "uvicorn",
                "portal.asgi:application",
                "--host",
                host,
                "--port",
                str(port),
                "--no-access-log",
            ],
            {},
        ),
        (
            "control",
            _celery("worker", "-Q", "control", "-n", "control@%h", "-P", "threads", "-c", "4"),
            {"GPUSHARE_ROLE": "control"},
        ),
        ("beat", _celery("beat", "-s", str(var / "celerybeat-schedule")), {"GPUSHARE_ROLE": "beat"}),
    ]
    for name, spec in DEMO_HOSTS.items():
        procs.append(
            (
                f"agent:{name}",
                _celery("worker", "-Q", f"host.{name}", "-n", f"agent-{name}@%h", "-P", "threads", "-c", "4"),
                {
                    "GPUSHARE_ROLE": "agent",
                    "GPUSHARE_HOST": name,
                    "GPUSHARE_SIM_GPUS": spec,
                    "GPU_BACKEND": "simulated",
                    "SANDBOX_DRIVER": driver,
                },
            )
        )
    return procs


def _pump(name: str, stream: object) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        sys.stdout.write(f"{name:>18} | {line}")
        sys.stdout.flush()


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("DEBUG", "true")
    port = int(os.environ.get("PORT", "8000"))
    bind = os.environ.get("BIND", "127.0.0.1")
    config.ensure_embedded_redis()
    manage = [PY, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], check=True)  # noqa: S603 - fixed argv
    subprocess.run([*manage, "seed_demo"], check=True)  # noqa: S603 - fixed argv
    running: list[tuple[str, subprocess.Popen[str]]] = []
    driver, why = choose_driver()
    if why:
        print(f"gpushare: {why}", flush=True)
    for name, argv, extra in commands(port, bind, driver):
        proc = subprocess.Popen(  # noqa: S603 - argv from commands() above, no shell
            argv,
            env={**os.environ, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our Ctrl-C is forwarded once, by us
        )
        threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True).start()
        running.append((name, proc))
    logins = ", ".join(f"{u} / {p}" for u, p in DEMO_USERS.items())
    print(
        f"\n  gpushare is starting on http://{bind}:{port}/  (health: /healthz)\n"
        f"  demo logins: {logins}\n  simulated hosts: {', '.join(DEMO_HOSTS)} (sandbox driver: {driver})\n"
        "  Ctrl-C stops everything.\n",
        flush=True,
    )
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    exit_code = 0
    while not stopping.is_set():
        for name, proc in running:
            if proc.poll() is not None:
                print(f"gpushare: {name} exited with {proc.returncode}; stopping the rest", flush=True)
                exit_code = 1
                stopping.set()
        stopping.wait(0.5)
    print("gpushare: stopping…", flush=True)
    for _, proc in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for _, proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    embedded = config.embedded_redis_dir()
    if embedded is not None:
        from portal.embedded_redis import stop

        stop(embedded)
    print("gpushare: stopped.", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
