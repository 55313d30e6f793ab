"""The client is a package of its own (client/): it imports nothing but the standard library,
httpx and websockets, declares exactly those, and its lock agrees with the portal's locks
on every package both hold (one virtualenv holds both: `make install`)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
ALLOWED = {"httpx", "websockets", "gpushare_client"}


def _pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.split()[0].strip()
    return pins


def test_the_client_imports_only_the_standard_library_httpx_and_websockets() -> None:
    imported: set[tuple[str, str]] = set()
    for path in sorted((CLIENT / "gpushare_client").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {(path.name, alias.name.split(".")[0]) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add((path.name, node.module.split(".")[0]))
    outside = sorted((f, m) for f, m in imported if m not in ALLOWED and m not in sys.stdlib_module_names)
    assert outside == []
    assert {m for _, m in imported} >= {"httpx", "websockets"}


def test_importing_the_client_loads_no_part_of_the_portal() -> None:
    probe = (
        "import sys, gpushare_client.cli, gpushare_client.shell; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'rest_framework', 'portal', "
        "'workers', 'scheduler', 'channels', 'celery'}))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd="/", timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_it_declares_what_it_imports_and_its_lock_agrees_with_the_portals() -> None:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    names = sorted(d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"])
    assert names == ["httpx", "websockets"]
    assert project["scripts"] == {"gpushare": "gpushare_client.cli:run"}
    ours = _pins(CLIENT / "requirements.lock")
    assert {"httpx", "websockets"} <= set(ours)
    for lock in ("base.lock", "dev.lock"):
        theirs = _pins(ROOT / "requirements" / lock)
        differ = {
            name: (ours[name], theirs[name]) for name in set(ours) & set(theirs) if ours[name] != theirs[name]
        }
        assert differ == {}, f"client/requirements.lock and requirements/{lock} pin these differently"
    websockets = next(d for d in project["dependencies"] if d.startswith("websockets"))
    major = int(_pins(ROOT / "requirements" / "base.lock")["websockets"].split(".")[0])
    assert websockets == "websockets>=13,<18" and 13 <= major < 18  # uvicorn[standard]'s fits the range
