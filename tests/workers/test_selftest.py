"""An agent's start-up self-test, and what an operator sees when a driver cannot launch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portal import launcher
from tests.workers.engines import require_engine
from wire import signing
from wire.celery import CHATTY_LOGGERS, _quiet_task_lines
from workers.drivers import DriverUnavailable, make_driver
from workers.drivers.process import bwrap_available
from workers.host import selftest
from workers.host.selftest import SelfTest

ROOT = Path(__file__).resolve().parents[2]


def _path_without_bwrap(tmp_path: Path) -> str:
    """A PATH holding this machine's tools except bwrap (links to everything else)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.access(directory, os.R_OK | os.X_OK):  # another user's folder on an inherited PATH
            continue
        for tool in Path(directory).glob("*") if Path(directory).is_dir() else ():
            target = bin_dir / tool.name
            if tool.name != "bwrap" and not target.exists():
                target.symlink_to(tool)
    return str(bin_dir)


@pytest.mark.bwrap
def test_the_process_driver_passes_by_launching_and_stopping_a_sandbox(tmp_path: Path) -> None:
    require_engine(bwrap_available(), "bubblewrap (bwrap) with user namespaces")
    result = selftest.run("process", "selftest-host", tmp_path / "sandboxes")
    assert result.ok, result.describe()
    assert "launched and stopped" in result.detail
    assert not list((tmp_path / "sandboxes").glob("*.json")), "the test sandbox was left behind"


def test_without_bubblewrap_the_process_driver_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", _path_without_bwrap(tmp_path))
    with pytest.raises(DriverUnavailable) as missing:
        make_driver("process", "h1", tmp_path)
    assert "bubblewrap" in missing.value.reason
    assert "install" in missing.value.remedy and "bubblewrap" in missing.value.remedy
    result = selftest.run("process", "h1", tmp_path)
    assert not result.ok
    assert "to fix:" in result.describe() and "bubblewrap" in result.describe()


@pytest.mark.e2e
def test_an_agent_whose_driver_cannot_launch_refuses_to_start(tmp_path: Path) -> None:
    """The agent exits 78 (EX_CONFIG) before taking a task, its log saying why and what to do."""
    env = {
        **os.environ,
        "PATH": _path_without_bwrap(tmp_path),
        "GPUSHARE_ROLE": "agent",
        "GPUSHARE_HOST": "selftest-refused",
        "GPUSHARE_SIM_GPUS": "A100-80GB:1",
        "GPU_BACKEND": "simulated",
        "SANDBOX_DRIVER": "process",
        "GPUSHARE_VAR_DIR": str(tmp_path / "var"),
        "GPUSHARE_HOST_KEY": signing.new_private_key(),
        "GPUSHARE_CONTROL_PUBLIC_KEY": signing.public_text(signing.private_key(signing.new_private_key())),
    }
    argv = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "host.selftest-refused"]
    done = subprocess.run(
        [*argv, "-P", "threads", "-c", "1", "--loglevel=INFO"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 78, done.stdout + done.stderr
    assert "bubblewrap (bwrap) is not installed" in done.stderr
    assert "to fix:" in done.stderr and "install" in done.stderr


def test_the_banner_names_an_agent_that_did_not_start_and_what_to_do() -> None:
    tests = {
        "sim-a": SelfTest(True, "process", "a test sandbox launched and stopped in 0.4 s"),
        "sim-b": SelfTest(
            False, "process", "bubblewrap (bwrap) is not installed", "apt-get install -y bubblewrap"
        ),
    }
    text = launcher.banner(8000, "127.0.0.1", tests)
    assert "simulated host sim-a: agent started" in text
    assert "simulated host sim-b: agent NOT started" in text
    assert "to fix: apt-get install -y bubblewrap" in text
    assert "LOG_LEVEL=debug" in text


@pytest.mark.parametrize(("level", "quiet"), [("INFO", True), ("WARNING", True), ("DEBUG", False)])
def test_celery_lines_per_task_show_only_at_debug(level: str, quiet: bool) -> None:
    saved = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    try:
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        _quiet_task_lines(loglevel=getattr(logging, level))
        for name in CHATTY_LOGGERS:
            assert (logging.getLogger(name).level == logging.WARNING) is quiet, name
    finally:
        for name, value in saved.items():
            logging.getLogger(name).setLevel(value)


@pytest.mark.e2e
def test_an_agent_without_its_keys_refuses_to_start(tmp_path: Path) -> None:
    """No host key (it would report unsigned, and be dropped) or no control-plane key (it could
    not tell the control plane's messages from another's): exit 78, saying which and how."""
    base = {
        **os.environ,
        "GPUSHARE_ROLE": "agent",
        "GPUSHARE_HOST": "keyless",
        "GPU_BACKEND": "simulated",
        "SANDBOX_DRIVER": "simulated",
        "GPUSHARE_VAR_DIR": str(tmp_path / "var"),
    }
    for name in ("GPUSHARE_HOST_KEY", "GPUSHARE_CONTROL_PUBLIC_KEY"):
        base.pop(name, None)
    argv = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "host.keyless", "-P", "threads"]
    without_own = subprocess.run(
        argv, env=base, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert without_own.returncode == 78, without_own.stdout + without_own.stderr
    assert "GPUSHARE_HOST_KEY_FILE" in without_own.stderr and "host_credential issue" in without_own.stderr
    own = {**base, "GPUSHARE_HOST_KEY": signing.new_private_key()}
    without_control = subprocess.run(
        argv, env=own, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert without_control.returncode == 78, without_control.stdout + without_control.stderr
    assert "GPUSHARE_CONTROL_PUBLIC_KEY_FILE" in without_control.stderr
