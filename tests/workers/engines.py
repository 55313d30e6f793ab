"""Skip-or-fail for tests that need a real engine (Docker, bubblewrap...).

On a developer machine a missing engine skips the test with the reason. In CI
(``CI=true``) the engines are part of the contract, so a missing one fails the test
instead of letting a green run hide that nothing was exercised.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_engine(available: bool, what: str) -> None:
    if available:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} is not available, and CI=true requires it", pytrace=False)
    pytest.skip(f"{what} is not available")


def require_module(name: str, what: str) -> ModuleType:
    """Import ``name`` for a whole test module, or skip (fail in CI) the module without it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{what} is not installed, and CI=true requires it", pytrace=False)
        pytest.skip(f"{what} is not installed", allow_module_level=True)
