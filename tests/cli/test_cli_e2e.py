"""The command-line client from a fresh virtualenv holding it alone (no Django, no portal
code), against a real platform: the web server, a control worker, an agent running Docker
containers. A scenario of steps (tests/conftest.py's ``steps``): sign in, be refused, request
with --wait and watch it start, open its shell, read its history and a batch run's output,
extend, stop, sign out; every command's --json parses."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.quotas.models import QuotaPolicy
from tests.cli.schema_check import mismatches
from tests.e2e.platform import ROOT, Platform, running_platform, wait_for
from tests.workers.engines import require_engine

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow]
IMAGE = "gpushare/sandbox-base:1"  # the catalog's busybox image (tests/factories.py)
REQUEST = ["request", "--project", "vision", "--tier", "dedicated", "--image", "busybox", "--gpus", "1"]


@dataclass
class Done:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        try:
            return json.loads(self.out)
        except ValueError as exc:
            raise AssertionError(
                f"not one JSON document on stdout: {self.out!r} (stderr: {self.err})"
            ) from exc


@dataclass
class Client:
    """The fresh virtualenv's ``gpushare``, with an environment of its own (no token in it)."""

    venv: Path
    home: Path

    def __call__(self, *argv: str, stdin: str = "", timeout: float = 180) -> Done:
        env = {
            "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin", "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / "config"), "LANG": "C.UTF-8",
        }  # fmt: skip
        done = subprocess.run(
            [str(self.venv / "bin" / "gpushare"), *argv], input=stdin, capture_output=True, text=True,
            env=env, cwd=self.home, timeout=timeout,
        )  # fmt: skip
        return Done(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="class")
def client(tmp_path_factory: pytest.TempPathFactory) -> Client:
    """``python -m venv``, then the client's lock and the client alone, as its README says."""
    where = tmp_path_factory.mktemp("client")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    uv = ROOT / ".venv" / "bin" / "uv"
    # Built from a copy: a build leaves build/ beside the sources, which the tree must not get.
    source = shutil.copytree(
        ROOT / "client", where / "source", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    for args in (["-r", "client/requirements.lock"], ["--no-deps", str(source)]):
        done = subprocess.run(
            [str(uv), "pip", "install", "-q", "-p", str(venv / "bin" / "python"), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    (where / "home").mkdir()
    return Client(venv, where / "home")


@pytest.fixture(scope="class")
def platform(world: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from workers.drivers.docker import docker_available

    require_engine(docker_available(), "a Docker engine")
    import docker

    try:
        docker.from_env().images.get(IMAGE)
    except docker.errors.ImageNotFound:
        require_engine(False, f"the image {IMAGE} (scripts/build-sandbox-image.sh)")
    # Three whole GPUs: the interactive sandbox and the batch run hold one each.
    with running_platform(tmp_path_factory.mktemp("platform"), web=True, sim_gpus="H100-80GB:3") as platform:
        yield platform


def url(platform: Platform) -> str:
    return f"http://127.0.0.1:{platform.port}"


@pytest.mark.steps
@pytest.mark.usefixtures("scenario_db")
class TestTheClientFromAFreshVirtualenv:
    def test_01_the_venv_holds_the_client_and_no_django(self, client: Client) -> None:
        python = str(client.venv / "bin" / "python")
        assert subprocess.run([python, "-c", "import django"], capture_output=True).returncode != 0
        assert (
            subprocess.run([python, "-c", "import gpushare_client.cli"], capture_output=True).returncode == 0
        )
        version = client("--version")
        assert version.code == 0 and version.out.startswith("gpushare "), version

    def test_02_login_checks_the_token_and_saves_it_privately(
        self, client: Client, platform: Platform, world: Any, state: dict[str, Any]
    ) -> None:
        _, key = ApiToken.issue(
            world["owner"], "laptop", ["read:usage", "write:sandboxes"], timezone.now() + timedelta(days=7)
        )
        wrong = client("login", url(platform), "--token-stdin", stdin="gps_wrong\n")
        assert wrong.code == 4 and "Invalid or revoked API token." in wrong.err, wrong
        done = client("login", url(platform), "--token-stdin", "--json", stdin=key + "\n")
        assert done.code == 0, done
        assert [p["slug"] for p in done.json()["projects"]] == ["vision"]
        saved = Path(done.json()["saved_to"])
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and json.loads(saved.read_text())["token"] == key

    def test_03_the_portals_live_schema_has_every_route_and_field_the_client_uses(
        self, platform: Platform
    ) -> None:
        schema = httpx.get(f"{url(platform)}/api/schema/", params={"format": "json"}, timeout=30).json()
        assert mismatches(schema) == []

    def test_04_a_refused_request_exits_3_with_the_reason(self, client: Client, world: Any) -> None:
        unknown = client("request", "--project", "vision", "--tier", "gold", "--image", "busybox")
        assert unknown.code == 3 and "tier: No such open tier." in unknown.err, unknown
        vm = client(*REQUEST, "--isolation", "vm", "--json")
        assert vm.code == 3 and vm.json()["error"]["fields"] == {
            "isolation": ["The tier Dedicated allows isolation: container, process."]
        }
        quota = QuotaPolicy.objects.create(project=world["project"], max_live_sandboxes=0)
        try:
            over = client(*REQUEST)
        finally:
            quota.delete()
        assert (
            over.code == 3
            and "project: Project Vision has reached its quota of 0 live sandboxes." in over.err
        )
        assert client("list", "--json").json() == {"sandboxes": []}  # nothing was requested

    def test_05_a_request_shows_where_it_starts_and_waits_until_running(
        self, client: Client, platform: Platform, state: dict[str, Any]
    ) -> None:
        dry = client(*REQUEST, "--dry-run", "--json")
        assert dry.code == 0 and dry.json()["preview"]["verdict"] == "now", dry
        done = client(*REQUEST, "--name", "e2e-shell", "--wait", "--timeout", "120")
        assert done.code == 0, done
        state["id"] = sandbox_id = int(done.out.strip())
        lines = done.err.splitlines()
        assert f"Would start: starts now on {platform.host}." in lines
        progress = [line for line in lines if line.startswith(f"sandbox {sandbox_id}: ")]
        assert progress[0].startswith(f"sandbox {sandbox_id}: queued") and len(progress) >= 2, lines
        assert progress[-1] == f"sandbox {sandbox_id}: running on {platform.host}"

    def test_06_list_and_show(self, client: Client, state: dict[str, Any]) -> None:
        listed = client("list")
        assert listed.code == 0, listed
        rows = [line.split()[:5] for line in listed.out.splitlines()[1:]]
        assert rows == [[str(state["id"]), "e2e-shell", "vision", "dedicated", "running"]], listed.out
        assert [s["id"] for s in client("list", "--json").json()["sandboxes"]] == [state["id"]]
        shown = client("show", str(state["id"]), "--json").json()
        assert shown["state"] == "running" and shown["name"] == "e2e-shell" and shown["image"] == "busybox"

    def test_07_its_shell_runs_echo_hi(
        self, client: Client, platform: Platform, state: dict[str, Any]
    ) -> None:
        piped = client("shell", str(state["id"]), stdin="echo hi\nexit\n")
        assert piped.code == 0 and piped.out == "hi\n", piped
        command = client("shell", str(state["id"]), "-c", "echo hi")
        assert command.code == 0 and command.out == "hi\n", command
        assert client("shell", str(state["id"]), "-c", "exit 3").code == 3
        as_json = client("shell", str(state["id"]), "-c", "echo hi; id -u", "--json")
        document = as_json.json()
        assert document["output"].splitlines()[0] == "hi" and document["exit_status"] == 0
        assert document["output"].splitlines()[1] != "0"  # the sandbox's user, not root

    def test_08_logs_show_its_history(
        self, client: Client, platform: Platform, state: dict[str, Any]
    ) -> None:
        done = client("logs", str(state["id"]))
        assert done.code == 0, done
        for words in ("requested", "queued -> placing", "starting -> running", "terminal opened by olivia"):
            assert words in done.out, (words, done.out)
        events = client("logs", str(state["id"]), "--json").json()["events"]
        assert [e["to_state"] for e in events][:5] == [
            "requested",
            "queued",
            "placing",
            "starting",
            "running",
        ]

    def test_09_extend(self, client: Client, state: dict[str, Any]) -> None:
        done = client("extend", str(state["id"]), "--hours", "1", "--json")
        assert done.code == 0 and done.json()["max_duration_hours"] == 2.0, done
        refused = client("extend", str(state["id"]), "--hours", "3")
        assert refused.code == 3 and "hours: Give one of: 1, 2, 4, 8." in refused.err

    def test_10_a_batch_run_and_its_output(
        self, client: Client, platform: Platform, state: dict[str, Any]
    ) -> None:
        done = client(*REQUEST, "--command", "sh -c 'echo batch-says-hello; echo to-stderr >&2'", "--wait",
                      "--timeout", "120")  # fmt: skip
        assert done.code == 0, done
        batch = int(done.out.strip())
        logs = client("logs", str(batch), "--follow")  # on until the host's last output came
        assert logs.code == 0, logs
        printed = re.split(r"--- output \(bytes 0 to \d+ of \d+\) ---\n", logs.out)[1].splitlines()
        assert {"batch-says-hello", "to-stderr"} <= set(printed), logs.out  # two streams: in any order
        document = client("logs", str(batch), "--json").json()
        assert document["sandbox"]["state"] == "stopped" and document["output"]["complete"] is True
        assert "batch-says-hello" in document["output"]["text"]

    def test_11_usage_and_invoices(self, client: Client, state: dict[str, Any]) -> None:
        usage = client("usage", "--project", "vision", "--json")
        assert usage.code == 0 and state["id"] in {r["sandbox"] for r in usage.json()["records"]}, usage
        assert client("usage").code == 0
        invoices = client("invoices", "--json")
        assert invoices.code == 0 and invoices.json() == {"invoices": []}

    def test_12_stop(self, client: Client, platform: Platform, state: dict[str, Any]) -> None:
        done = client("stop", str(state["id"]), "--json")
        assert done.code == 0 and done.json()["state"] in ("stopping", "stopped"), done
        wait_for(
            lambda: client("show", str(state["id"]), "--json").json()["state"] == "stopped", 60, "the stop"
        )
        ended = client("shell", str(state["id"]), "-c", "true")
        assert ended.code == 3 and "is stopped, not running" in ended.err

    def test_13_logout(self, client: Client) -> None:
        done = client("logout", "--json")
        assert done.code == 0 and done.json()["signed_out"] is True
        after = client("list", "--json")
        assert after.code == 4 and after.json()["error"]["kind"] == "auth"
