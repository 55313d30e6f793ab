"""Typed environment helpers for settings: fail loudly, naming the variable.

Every secret may come from ``NAME_FILE`` instead of ``NAME`` (Docker/Kubernetes secrets,
systemd credentials): the file's content, stripped of surrounding whitespace, is the value.
Both at once is an error, not a silent precedence, so a stale variable cannot win.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path


class ConfigError(Exception):
    """A setting from the environment is missing or malformed."""


def _raw(name: str) -> str | None:
    file_var = f"{name}_FILE"
    if os.environ.get(file_var):
        if os.environ.get(name):
            raise ConfigError(f"{name} and {file_var} are both set: set one of them")
        path = Path(os.environ[file_var])
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{file_var}: cannot read {path}: {exc.strerror}") from exc
        if not value:
            # A file named on purpose but empty is a broken deployment, not "unset".
            raise ConfigError(f"{file_var}: {path} is empty")
        return value
    return os.environ.get(name)


def env_str(name: str, default: str | None = None) -> str:
    value = _raw(name)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{name} is required but not set")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name}={number} must be at least {minimum}")
    return number


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    value = env_str(name, default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(choices)}")
    return value


def env_list(name: str, default: Sequence[str]) -> list[str]:
    value = _raw(name)
    if value is None or value.strip() == "":
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def env_networks(name: str) -> tuple[IPNetwork, ...]:
    """A comma-separated list of addresses or CIDR networks (``10.0.0.0/8, fd00::/8``).
    A network with host bits set (``10.0.0.1/8``) is an error, not silently widened."""
    networks = []
    for item in env_list(name, []):
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ConfigError(f"{name}: {item!r} is not an address or network ({exc})") from None
    return tuple(networks)
