"""Single sign-on from the environment: off until asked for, then every variable it needs
is required and a malformed one names itself at start-up (portal/identity/config.py)."""

from __future__ import annotations

import pytest

from portal.identity.config import authentication_backends, ldap_settings, oidc_settings
from wire.env import ConfigError


def test_both_are_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OIDC_RP_CLIENT_ID", "LDAP_SERVER_URI"):
        monkeypatch.delenv(name, raising=False)
    assert oidc_settings() == {"OIDC_ENABLED": False}
    assert ldap_settings() == {"LDAP_ENABLED": False}
    # Django's own backend by its own name: sessions made before single sign-on still hold.
    assert authentication_backends(False, False) == ["django.contrib.auth.backends.ModelBackend"]
    assert authentication_backends(True, True, "staff") == [
        "portal.identity.local.StaffOnlyPasswordBackend",
        "portal.identity.ldap_backend.PortalLDAPBackend",
        "portal.identity.oidc_backend.PortalOIDCBackend",
    ]


def test_an_oidc_client_without_its_endpoints_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OIDC_RP_CLIENT_ID", "portal")
    monkeypatch.setenv("OIDC_OP_TOKEN_ENDPOINT", "https://idp.example.org/token")
    with pytest.raises(ConfigError, match="OIDC_OP_AUTHORIZATION_ENDPOINT, OIDC_OP_USER_ENDPOINT"):
        oidc_settings()


def test_oidc_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTHORIZATION", "TOKEN", "USER", "JWKS"):
        monkeypatch.setenv(f"OIDC_OP_{name}_ENDPOINT", f"https://idp.example.org/{name.lower()}")
    monkeypatch.setenv("OIDC_RP_CLIENT_ID", "portal")
    monkeypatch.setenv("OIDC_RP_CLIENT_SECRET", "s3cret")
    monkeypatch.setenv("OIDC_RP_SIGN_ALGO", "es256")
    made = oidc_settings()
    assert made["OIDC_ENABLED"] and made["OIDC_RP_SIGN_ALGO"] == "ES256" and made["OIDC_USE_PKCE"]
    monkeypatch.setenv("OIDC_RP_SIGN_ALGO", "none")
    with pytest.raises(ConfigError, match="OIDC_RP_SIGN_ALGO"):
        oidc_settings()


def test_ldap_needs_its_search_bases_and_a_user_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("django_auth_ldap", reason="the LDAP extra (make install-ldap)")
    monkeypatch.setenv("LDAP_SERVER_URI", "ldap://ldap.example.org")
    with pytest.raises(ConfigError, match="LDAP_USER_SEARCH_BASE, LDAP_GROUP_SEARCH_BASE"):
        ldap_settings()
    monkeypatch.setenv("LDAP_USER_SEARCH_BASE", "ou=people,dc=example,dc=org")
    monkeypatch.setenv("LDAP_GROUP_SEARCH_BASE", "ou=groups,dc=example,dc=org")
    monkeypatch.setenv("LDAP_USER_FILTER", "(uid=alice)")
    with pytest.raises(ConfigError, match=r"must contain %\(user\)s"):
        ldap_settings()
    monkeypatch.setenv("LDAP_USER_FILTER", "(sAMAccountName=%(user)s)")
    monkeypatch.setenv("LDAP_GROUP_TYPE", "posixGroup")
    made = ldap_settings()
    assert made["LDAP_ENABLED"] and made["AUTH_LDAP_USER_SEARCH"].filterstr == "(sAMAccountName=%(user)s)"
    assert type(made["AUTH_LDAP_GROUP_TYPE"]).__name__ == "PosixGroupType"
