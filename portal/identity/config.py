"""Single sign-on settings from the environment, read by ``portal.settings``: each provider
is off until its first variable is set, and then every variable it needs is required.

Imports no model: settings load before the apps do.
"""

from __future__ import annotations

from typing import Any

from wire.env import ConfigError, env_bool, env_choice, env_str

OIDC_ENDPOINTS = (
    "OIDC_OP_AUTHORIZATION_ENDPOINT",
    "OIDC_OP_TOKEN_ENDPOINT",
    "OIDC_OP_USER_ENDPOINT",
    "OIDC_OP_JWKS_ENDPOINT",
)
LDAP_GROUP_TYPES = ("groupofnames", "groupofuniquenames", "posixgroup")  # any case


def oidc_settings() -> dict[str, Any]:
    """mozilla-django-oidc's settings when ``OIDC_RP_CLIENT_ID`` is set, else OIDC is off."""
    client_id = env_str("OIDC_RP_CLIENT_ID", "")
    if not client_id:
        return {"OIDC_ENABLED": False}
    missing = [name for name in (*OIDC_ENDPOINTS, "OIDC_RP_CLIENT_SECRET") if not env_str(name, "")]
    if missing:
        raise ConfigError(
            f"OIDC_RP_CLIENT_ID is set, so OpenID Connect needs {', '.join(missing)} too "
            "(the endpoints are in the provider's /.well-known/openid-configuration)"
        )
    return {
        "OIDC_ENABLED": True,
        "OIDC_RP_CLIENT_ID": client_id,
        "OIDC_RP_CLIENT_SECRET": env_str("OIDC_RP_CLIENT_SECRET"),
        **{name: env_str(name) for name in OIDC_ENDPOINTS},
        "OIDC_RP_SIGN_ALGO": env_choice("OIDC_RP_SIGN_ALGO", ("rs256", "es256", "hs256"), "rs256").upper(),
        "OIDC_RP_SCOPES": env_str("OIDC_RP_SCOPES", "openid email profile groups"),
        "OIDC_GROUPS_CLAIM": env_str("OIDC_GROUPS_CLAIM", "groups"),
        "OIDC_PROVIDER_NAME": env_str("OIDC_PROVIDER_NAME", "your organisation"),
        "OIDC_USE_PKCE": True,
        "OIDC_USE_NONCE": True,
        "OIDC_VERIFY_SSL": env_bool("OIDC_VERIFY_SSL", True),
        "OIDC_TIMEOUT": 10,
        "LOGIN_REDIRECT_URL_FAILURE": "/login/?sso=failed",
    }


def ldap_settings() -> dict[str, Any]:
    """django-auth-ldap's settings when ``LDAP_SERVER_URI`` is set, else LDAP is off."""
    uri = env_str("LDAP_SERVER_URI", "")
    if not uri:
        return {"LDAP_ENABLED": False}
    try:
        import ldap
        from django_auth_ldap.config import (
            GroupOfNamesType,
            GroupOfUniqueNamesType,
            LDAPSearch,
            PosixGroupType,
        )
    except ImportError as exc:
        raise ConfigError(
            "LDAP_SERVER_URI is set but the LDAP extra is not installed "
            "(apt-get install libldap2-dev libsasl2-dev; make install-ldap)"
        ) from exc
    missing = [name for name in ("LDAP_USER_SEARCH_BASE", "LDAP_GROUP_SEARCH_BASE") if not env_str(name, "")]
    if missing:
        raise ConfigError(f"LDAP_SERVER_URI is set, so LDAP needs {', '.join(missing)} too")
    group_type = env_choice("LDAP_GROUP_TYPE", LDAP_GROUP_TYPES, "groupofnames")
    user_filter = env_str("LDAP_USER_FILTER", "(uid=%(user)s)")
    if "%(user)s" not in user_filter:
        raise ConfigError(f"LDAP_USER_FILTER must contain %(user)s, not {user_filter!r}")
    types = {
        "groupofnames": (GroupOfNamesType, "(objectClass=groupOfNames)"),
        "groupofuniquenames": (GroupOfUniqueNamesType, "(objectClass=groupOfUniqueNames)"),
        "posixgroup": (PosixGroupType, "(objectClass=posixGroup)"),
    }
    type_class, group_filter = types[group_type]
    options: dict[Any, Any] = {ldap.OPT_REFERRALS: 0, ldap.OPT_NETWORK_TIMEOUT: 10}
    ca_file = env_str("LDAP_CA_FILE", "")
    if ca_file:
        options[ldap.OPT_X_TLS_CACERTFILE] = ca_file
        options[ldap.OPT_X_TLS_NEWCTX] = 0
    return {
        "LDAP_ENABLED": True,
        "AUTH_LDAP_SERVER_URI": uri,
        "AUTH_LDAP_BIND_DN": env_str("LDAP_BIND_DN", ""),
        "AUTH_LDAP_BIND_PASSWORD": env_str("LDAP_BIND_PASSWORD", ""),
        "AUTH_LDAP_START_TLS": env_bool("LDAP_START_TLS", False),
        "AUTH_LDAP_CONNECTION_OPTIONS": options,
        "AUTH_LDAP_USER_SEARCH": LDAPSearch(
            env_str("LDAP_USER_SEARCH_BASE"), ldap.SCOPE_SUBTREE, user_filter
        ),
        "AUTH_LDAP_GROUP_SEARCH": LDAPSearch(
            env_str("LDAP_GROUP_SEARCH_BASE"), ldap.SCOPE_SUBTREE, group_filter
        ),
        "AUTH_LDAP_GROUP_TYPE": type_class(),
        "AUTH_LDAP_USER_ATTR_MAP": {"first_name": "givenName", "last_name": "sn", "email": "mail"},
        "AUTH_LDAP_ALWAYS_UPDATE_USER": True,
        # Groups are read at every sign-in: the rules apply what the directory says now.
        "AUTH_LDAP_CACHE_TIMEOUT": 0,
    }


def authentication_backends(oidc: bool, ldap: bool, local_sign_in: str = "everyone") -> list[str]:
    """Local accounts first (admins keep signing in when a provider is down), then LDAP
    (same sign-in form), then OIDC (its own callback). Local accounts for everyone is
    Django's own backend, by its own name: a session records its backend's dotted path, so
    sessions made before single sign-on was set up keep working."""
    local = (
        "django.contrib.auth.backends.ModelBackend"
        if local_sign_in == "everyone"
        else "portal.identity.local.StaffOnlyPasswordBackend"
    )
    return [
        local,
        *(["portal.identity.ldap_backend.PortalLDAPBackend"] if ldap else []),
        *(["portal.identity.oidc_backend.PortalOIDCBackend"] if oidc else []),
    ]
