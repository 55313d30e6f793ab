"""make run on a machine without bubblewrap (or, with Docker, debootstrap for the image): the
launcher installs it with apt-get as root, quietly when that works, and names apt's own
complaint when it does not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portal.launcher import ensure_bubblewrap, ensure_package

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher installs packages only as root")


def fake_apt(bin_dir: Path, script: str) -> None:
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\n" + script)
    apt.chmod(0o755)


def test_a_working_install_prints_nothing_of_apts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_apt(tmp_path, "echo 'debconf: delaying package configuration' >&2\nexit 0\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ensure_bubblewrap() == ""
    out = capsys.readouterr()
    assert "debconf" not in out.out + out.err


def test_a_failed_install_names_apts_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_apt(tmp_path, "echo 'E: Unable to locate package bubblewrap' >&2\nexit 100\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = ensure_bubblewrap()
    assert problem == "apt-get could not install bubblewrap: E: Unable to locate package bubblewrap"
    assert problem in capsys.readouterr().out


def test_the_image_builds_prerequisite_is_installed_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_apt(tmp_path, f'echo "$@" > {tmp_path}/asked\nexit 0\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ensure_package("debootstrap", "debootstrap", "to build the sandbox image") == ""
    assert (tmp_path / "asked").read_text().split()[-1] == "debootstrap"
    assert "installing debootstrap to build the sandbox image" in capsys.readouterr().out
