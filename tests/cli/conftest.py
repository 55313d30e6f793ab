"""Fixtures for the command-line client's tests: a run of ``gpushare`` in-process against
the fake portal (``Run``); the e2e scenario's people and state are tests/conftest.py's."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gpushare_client import api as client_api
from gpushare_client import commands
from gpushare_client.cli import main

from tests.cli.fake_portal import BASE, TOKEN, FakePortal


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class NotATerminal(io.StringIO):
    def isatty(self) -> bool:
        return False


@dataclass
class Run:
    """``gpushare ARGS`` with the fake portal behind it and a config folder of its own."""

    portal: FakePortal
    home: Path
    env: dict[str, str]

    def __call__(self, *argv: str, stdin: str = "") -> Result:
        out, err = io.StringIO(), io.StringIO()
        code = main(list(argv), env=self.env, stdin=NotATerminal(stdin), stdout=out, stderr=err)
        return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def portal() -> FakePortal:
    return FakePortal()


@pytest.fixture
def gpushare(portal: FakePortal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Signed in through the environment; ``env`` may be changed by a test."""
    real = client_api.Api

    def fake_api(credentials: Any, **kwargs: Any) -> Any:
        return real(credentials, transport=portal.transport())

    monkeypatch.setattr(commands, "Api", fake_api)
    monkeypatch.setattr("gpushare_client.waiting.POLL_S", 0.001)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "GPUSHARE_URL": BASE, "GPUSHARE_TOKEN": TOKEN}
    return Run(portal, tmp_path, env)
