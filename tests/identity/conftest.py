"""The directory every LDAP test signs in against: slapd started for the test (module), the
portal's settings pointed at it as an operator's environment would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from tests.identity.servers import Directory, running_directory

PEOPLE = {"lena": "lena-directory-pass", "admin": "directory-admin-pass", "tom": "tom-directory-pass"}
GROUPS = {"ml-lab": ["lena", "tom"], "vision-leads": ["lena"], "staff": ["admin"]}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Directory]:
    folder: Path = tmp_path_factory.mktemp("slapd")
    with running_directory(folder, PEOPLE, {cn: list(members) for cn, members in GROUPS.items()}) as running:
        yield running


@pytest.fixture
def ldap_portal(directory: Directory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The portal's settings as ``LDAP_*`` variables make them (portal.identity.config)."""
    from portal.identity.config import authentication_backends, ldap_settings

    for name, value in directory.settings_env().items():
        monkeypatch.setenv(name, value)
    made = ldap_settings()
    with override_settings(**made, AUTHENTICATION_BACKENDS=authentication_backends(False, True)):
        yield directory
