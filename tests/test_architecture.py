"""The import rules import-linter cannot see: no first-party import inside a function.

import-linter (`make lint`, `.importlinter`) checks what may import what, but an import
hidden in a function body is the usual way to dodge a cycle it would report. The layers
leave no cycle to dodge, so the only imports allowed inside functions are these, each for
a reason that is not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("portal", "workers", "scheduler", "wire")

# (importing module, imported module prefix): why it is imported when called.
ALLOWED = {
    # AppConfig.ready(): the console (top layer) chooses which models the audit trail watches.
    ("portal.console.apps", "portal."): "AppConfig.ready() runs once the apps are loaded",
    ("portal.identity.apps", "portal.identity"): "django-auth-ldap is an optional extra",
    # Engines chosen at run time, some optional (libvirt-python is an extra).
    ("workers.drivers", "workers.drivers."): "a driver's engine is loaded only when chosen",
    ("portal.launcher", "workers.drivers.docker"): "`make run` asks Docker only if it is there",
}


def _function_level_imports() -> list[tuple[str, str, int]]:
    found = []
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            tree = ast.parse(path.read_text(), filename=str(path))
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        names = [node.module]
                    elif isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    else:
                        continue
                    found += [(module, n, node.lineno) for n in names if n.split(".")[0] in FIRST_PARTY]
    return sorted(set(found))


def test_no_first_party_import_hides_in_a_function_but_the_allowed_ones() -> None:
    hidden = [
        f"{module}:{line} imports {name}"
        for module, name, line in _function_level_imports()
        if not any(module == m and name.startswith(prefix) for m, prefix in ALLOWED)
    ]
    assert not hidden, "imports inside functions (move them to the top; fix the cycle):\n" + "\n".join(hidden)


def test_the_scan_sees_function_level_imports() -> None:
    """The allowed ones exist, so the scan reads function bodies at all."""
    modules = {module for module, _name, _line in _function_level_imports()}
    assert {"portal.console.apps", "workers.drivers"} <= modules


def test_the_scheduler_never_imports_its_research() -> None:
    """Research (trace replays, the paper's baselines, benchmarks and `make bench`) imports
    the product, never the reverse: what the portal runs carries no benchmark, and no cycle
    can form between the two. import-linter cannot say "scheduler but not its research"."""
    product = [p for p in sorted((ROOT / "scheduler").rglob("*.py")) if "research" not in p.parts]
    found = []
    for path in product:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.startswith("scheduler.research")
            ]
    assert product and not found, "the scheduler imports its research:\n" + "\n".join(found)
