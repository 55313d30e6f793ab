"""``make run``: the whole platform in one command, for a laptop or a demo.

Migrates, seeds the demo, then runs the ASGI server, a control worker, one host agent per
simulated demo host and celery beat, prefixing their output. Ctrl-C (or SIGTERM) stops
them all cleanly, then the embedded Redis. Production runs these as separate services.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from portal.demo import DEMO_HOST_SIZE, DEMO_HOSTS, DEMO_USERS
from wire import config, embedded_redis
from workers.host import selftest
from workers.host.selftest import SelfTest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


SANDBOX_IMAGE = selftest.SANDBOX_IMAGE
# What the terminal shows: warnings, errors and the sandbox transitions (their logger stays
# at INFO, portal/settings.py); LOG_LEVEL=debug shows every line of every process.
LOG_LEVEL = (os.environ.get("LOG_LEVEL") or "warning").upper()
DEBUG_LOGS = LOG_LEVEL == "DEBUG"
# Each agent's task threads (as deploy/systemd/gpushare-agent.service's -c). A launch spends
# its time waiting on the container engine (create, start), and a burst of requests queues
# its launches, and the stops of its finished batches, on these threads: with 4 a hundred
# requests waited ~19 s (p50) in the agents' queues, while the engine alone starts 50
# containers from 16 threads in two thirds of the time it takes from 4 (BENCHMARKS.md, "A
# burst of requests").
AGENT_THREADS = 16
# As the agent's systemd unit runs it: no gossip, mingle or worker heartbeats, whose shared
# channels and reply queues a host's own Redis user cannot reach (wire/broker_acl.py).
AGENT_WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")


def celery_command(*args: str) -> list[str]:
    quiet = [] if DEBUG_LOGS else ["--quiet"]  # no start-up banner with its task list
    # The agents run as root where the process driver gives each sandbox its own uid: Celery's
    # warning about root, once per process, says nothing the operator can act on here.
    root = ["-W", "ignore:You're running the worker with superuser privileges"] if os.geteuid() == 0 else []
    return [PY, *root, "-m", "celery", *quiet, "-A", "workers", *args, f"--loglevel={LOG_LEVEL}"]


def ensure_package(package: str, command: str, purpose: str) -> str:
    """A Debian package ``make run`` needs (``command`` is how we see it is there): installed
    with apt-get when we are root and it is missing. Returns "" when it is there, else what
    stopped us (printed; the caller's fallback or the agents' self-test says what to do)."""
    if shutil.which(command):
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{package} is not installed"
    print(f"gpushare: installing {package} {purpose} (apt-get install {package})…", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]

    errors: list[str] = []

    def run(argv: list[str]) -> bool:
        # stderr kept for a failure only: a working install still prints debconf's notes.
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)  # noqa: S603 (our own argv)
        errors.append(done.stderr.strip())
        return done.returncode == 0

    # A fresh machine's package lists may be missing or stale: update once and try again.
    if run(install) or (run(["apt-get", "update", "-q"]) and run(install)):
        return ""
    problem = f"apt-get could not install {package}: " + (errors[-1].splitlines() or ["no message"])[-1]
    print(f"gpushare: {problem}", flush=True)
    return problem


def ensure_bubblewrap() -> str:
    return ensure_package("bubblewrap", "bwrap", "for process sandboxes")


def choose_driver() -> tuple[str, str]:
    """The agents' sandbox driver, and a line for the operator when it is not Docker."""
    kind = config.sandbox_driver_kind()
    if kind == "process":
        ensure_bubblewrap()
    if kind != "auto":
        return kind, ""
    from workers.drivers.docker import docker_available

    if not docker_available():
        ensure_bubblewrap()
        return "process", "no Docker engine reachable: sandboxes run as bubblewrap processes"
    import docker

    try:
        docker.from_env().images.get(SANDBOX_IMAGE)
    except docker.errors.ImageNotFound:
        # The image is a Debian minbase (glibc, for what the NVIDIA toolkit injects).
        ensure_package("debootstrap", "debootstrap", "to build the sandbox image")
        print(f"gpushare: building the sandbox image {SANDBOX_IMAGE} (once)…", flush=True)
        built = subprocess.run(["bash", str(ROOT / "scripts" / "build-sandbox-image.sh")], check=False)  # noqa: S603, S607
        if built.returncode != 0:
            ensure_bubblewrap()
            return "process", f"could not build {SANDBOX_IMAGE}: sandboxes run as bubblewrap processes"
    return "docker", ""


def self_tests(driver: str) -> dict[str, SelfTest]:
    """Each demo agent's self-test (one sandbox launched and stopped), run side by side."""
    var = config.var_dir()
    with ThreadPoolExecutor(max_workers=len(DEMO_HOSTS)) as pool:
        futures = {
            host: pool.submit(selftest.run, driver, host, var / "agents" / host / "sandboxes")
            for host in DEMO_HOSTS
        }
        return {host: future.result() for host, future in futures.items()}


def commands(
    port: int, host: str, driver: str, agents: list[str]
) -> list[tuple[str, list[str], dict[str, str]]]:
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
                # Whose X-Forwarded-For to believe is TRUSTED_PROXIES' (portal/asgi.py): by
                # default uvicorn believes anyone on loopback, who could pick an address per
                # request and walk past the sign-in throttle.
                "--no-proxy-headers",
                # uvicorn's INFO is a line per WebSocket opened and closed: debug only.
                "--log-level",
                "debug" if DEBUG_LOGS else "warning",
            ],
            {},
        ),
        (
            "control",
            celery_command("worker", "-Q", "control", "-n", "control@%h", "-P", "threads", "-c", "4"),
            {"GPUSHARE_ROLE": "control"},
        ),
        ("beat", celery_command("beat", "-s", str(var / "celerybeat-schedule")), {"GPUSHARE_ROLE": "beat"}),
    ]
    for name in agents:
        procs.append(
            (
                f"agent:{name}",
                celery_command(
                    "worker",
                    "-Q",
                    f"host.{name}",
                    "-n",
                    f"agent-{name}@%h",
                    "-P",
                    "threads",
                    "-c",
                    str(AGENT_THREADS),
                    *AGENT_WORKER_FLAGS,
                ),
                {
                    "GPUSHARE_ROLE": "agent",
                    "GPUSHARE_HOST": name,
                    "GPUSHARE_SIM_GPUS": DEMO_HOSTS[name],
                    "GPUSHARE_SIM_HOST": DEMO_HOST_SIZE,
                    "GPU_BACKEND": "simulated",
                    "SANDBOX_DRIVER": driver,
                    "AGENT_SELFTEST": "false",  # main() ran it before starting the agent
                },
            )
        )
    return procs


def banner(port: int, bind: str, tests: dict[str, SelfTest]) -> str:
    logins = ", ".join(f"{u} / {p}" for u, p in DEMO_USERS.items())
    lines = [
        "",
        f"  gpushare is starting on http://{bind}:{port}/  (health: /healthz)",
        f"  demo logins: {logins}",
    ]
    for host, result in tests.items():
        state = "agent started" if result.ok else "agent NOT started"
        lines.append(f"  simulated host {host}: {state}; {result.describe()}")
    if not all(result.ok for result in tests.values()):
        lines.append("  Sandboxes wait in the queue until a host's agent runs: fix the above and restart.")
    lines += [
        "  logs: warnings, errors and one line per sandbox transition (LOG_LEVEL=debug: everything)",
        "  Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def _pump(name: str, stream: object) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        sys.stdout.write(f"{name:>18} | {line}")
        sys.stdout.flush()


def main() -> int:
    os.chdir(ROOT)
    os.environ.setdefault("DEBUG", "true")
    port = int(os.environ.get("PORT", "8000"))
    bind = os.environ.get("BIND", "127.0.0.1")
    # Links in the mails the control worker sends lead to this server.
    os.environ.setdefault("PORTAL_URL", f"http://{'localhost' if bind == '127.0.0.1' else bind}:{port}")
    # Sandboxes' apps on their own origins, <sandbox>-<key>.apps.localhost: browsers resolve
    # names under localhost to loopback themselves, which only a local browser reaches.
    if bind != "127.0.0.1" and "APPS_DOMAIN" not in os.environ:
        print(
            f"gpushare: apps are served at *.apps.localhost:{port}, which only this machine's "
            "browsers reach: set APPS_DOMAIN to a wildcard name that resolves here (deploy/README.md)"
        )
    config.ensure_embedded_redis()
    manage = [PY, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], check=True)  # noqa: S603 - fixed argv
    subprocess.run([*manage, "seed_demo"], check=True)  # noqa: S603 - fixed argv
    running: list[tuple[str, subprocess.Popen[str]]] = []
    driver, why = choose_driver()
    if why:
        print(f"gpushare: {why}", flush=True)
    tests = self_tests(driver)
    agents = [host for host, result in tests.items() if result.ok]
    # Each agent connects as its host's own Redis user and signs what it reports with its
    # host's key, as a deployed GPU host does (README, "A compromised GPU host"); new ones
    # each start. renew prints them as environment lines.
    enrolled = {
        name: dict(
            line.split("=", 1)
            for line in subprocess.run(  # noqa: S603 - fixed argv
                [*manage, "host_credential", "renew", name], check=True, capture_output=True, text=True
            ).stdout.splitlines()
            if "=" in line
        )
        for name in agents
    }
    for name, argv, extra in commands(port, bind, driver, agents):
        if name.startswith("agent:"):
            extra = {**extra, **enrolled[name.removeprefix("agent:")]}
        proc = subprocess.Popen(  # noqa: S603 - argv from commands() above, no shell
            argv,
            env={**os.environ, "LOG_LEVEL": LOG_LEVEL, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our Ctrl-C is forwarded once, by us
        )
        threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True).start()
        running.append((name, proc))
    print(banner(port, bind, tests), flush=True)
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
        embedded_redis.stop(embedded)
    print("gpushare: stopped.", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
