"""Where the client keeps its portal URL and API token, and how the environment overrides
them.

Saved by ``gpushare login`` in ``$XDG_CONFIG_HOME/gpushare/credentials.json`` (default
``~/.config``), the folder 0700 and the file 0600 from the moment it exists (written to a
private temporary file, then renamed over the old one). ``GPUSHARE_URL`` and
``GPUSHARE_TOKEN`` override what is saved, each on its own (CI jobs need no file at all).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gpushare_client.exits import ClientError, Exit

URL_ENV, TOKEN_ENV = "GPUSHARE_URL", "GPUSHARE_TOKEN"
FILE_NAME = "credentials.json"


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str


def config_dir(env: Mapping[str, str] = os.environ) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpushare"


def config_path(env: Mapping[str, str] = os.environ) -> Path:
    return config_dir(env) / FILE_NAME


def portal_url(raw: str) -> str:
    """The portal's base URL, checked: http or https, a host, no query; without its last /."""
    try:
        parts = urlsplit(raw.strip())
        parts.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError as exc:
        raise ClientError(Exit.USAGE, f"Not a URL: {raw!r} ({exc}).") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ClientError(Exit.USAGE, f"Give the portal's address as http(s)://host[:port], not {raw!r}.")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def is_plain_http_to_another_host(url: str) -> bool:
    """A token sent over plain HTTP beyond this machine can be read on the way."""
    parts = urlsplit(url)
    return parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1", "::1")


def _saved(env: Mapping[str, str]) -> dict[str, str]:
    path = config_path(env)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ClientError(Exit.ERROR, f"Cannot read {path}: {exc}. Run gpushare login again.") from exc
    if not isinstance(data, dict):
        raise ClientError(Exit.ERROR, f"{path} is not what gpushare login writes. Run gpushare login again.")
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def load(env: Mapping[str, str] = os.environ) -> Credentials:
    """The URL and token to use: the environment's, else the saved ones."""
    saved = _saved(env) if not (env.get(URL_ENV) and env.get(TOKEN_ENV)) else {}
    url = env.get(URL_ENV) or saved.get("url", "")
    token = env.get(TOKEN_ENV) or saved.get("token", "")
    if not url or not token:
        raise ClientError(
            Exit.AUTH, f"Not signed in: run gpushare login URL, or set {URL_ENV} and {TOKEN_ENV}."
        )
    return Credentials(portal_url(url), token.strip())


def save(credentials: Credentials, env: Mapping[str, str] = os.environ) -> Path:
    folder = config_dir(env)
    path = folder / FILE_NAME
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # mkstemp makes the file 0600 before a byte is written; the rename replaces the old one whole.
        fd, temporary = tempfile.mkstemp(prefix=".credentials-", dir=folder)
        try:
            with os.fdopen(fd, "w") as file:
                json.dump({"url": credentials.url, "token": credentials.token}, file)
            os.chmod(temporary, 0o600)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        raise ClientError(Exit.ERROR, f"Cannot save the token in {path}: {exc}.") from exc
    return path


def forget(env: Mapping[str, str] = os.environ) -> bool:
    """Remove the saved token; False if there was none."""
    path = config_path(env)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ClientError(Exit.ERROR, f"Cannot remove {path}: {exc}.") from exc
    return True
