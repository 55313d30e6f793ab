"""Where sandboxes' web apps are served: each on an origin of its own under ``APPS_DOMAIN``.

An app is its owner's code (a notebook, a package it installed, an HTML file a colleague left
in a project folder). On the portal's origin its scripts would be the portal's: a service
worker registered for ``/`` served its own ``/login/`` after the sandbox had stopped. So each
sandbox's app gets ``<scheme>://<label>.<APPS_DOMAIN>[:port]``, where the label is
``<sandbox id>-<allocation key>`` (a new origin for each placement, unguessable), as
JupyterHub's ``subdomain_host`` and GitHub's user-content domains do. Scheme and port are the
portal's (``PORTAL_URL``) unless ``APPS_DOMAIN`` names its own port.

Pure (no models): the settings parse ``APPS_DOMAIN`` with it at start-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.http.request import split_domain_port, validate_host

_LABEL = re.compile(r"(?P<sandbox>[1-9][0-9]{0,11})-(?P<key>[0-9a-f]{32})")
_DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,200}}$){_DNS_LABEL}(\.{_DNS_LABEL})*")
GRANT_PATH = "/__gpushare__/grant"  # on an app's origin: where the portal's grant is redeemed


class AppsDomainError(ValueError):
    pass


@dataclass(frozen=True)
class AppLabel:
    """Which sandbox an app origin's host names, and the allocation key it was made for."""

    sandbox_id: int
    allocation_key: str


@dataclass(frozen=True)
class AppsDomain:
    domain: str  # lower case, no port
    scheme: str  # http or https
    port: int | None  # None: the scheme's default

    @classmethod
    def parse(cls, value: str, portal_url: str) -> AppsDomain | None:
        """``APPS_DOMAIN`` (``apps.example.org`` or ``apps.example.org:8443``) with the portal's
        URL; None when it is empty (no app is served)."""
        value = value.strip().lower().rstrip(".")
        if not value:
            return None
        domain, _, port_text = value.partition(":")
        if not _HOSTNAME.fullmatch(domain) or ("." not in domain and domain != "localhost"):
            raise AppsDomainError(f"APPS_DOMAIN {value!r} is not a domain name (e.g. apps.gpus.example.org)")
        portal = urlsplit(portal_url)
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise AppsDomainError(f"APPS_DOMAIN {value!r}: {port_text!r} is not a port")
        port = int(port_text) if port_text else portal.port
        if portal.hostname and (portal.hostname == domain or portal.hostname.endswith("." + domain)):
            raise AppsDomainError(
                f"APPS_DOMAIN {domain} would hold the portal's own host {portal.hostname}: "
                f"apps need a domain of their own (e.g. apps.{portal.hostname})"
            )
        return cls(domain=domain, scheme=portal.scheme or "http", port=port)

    @property
    def secure(self) -> bool:
        return self.scheme == "https"

    def origin(self, sandbox_id: int, allocation_key: str) -> str:
        default = {"http": 80, "https": 443}[self.scheme]
        port = f":{self.port}" if self.port is not None and self.port != default else ""
        return f"{self.scheme}://{sandbox_id}-{allocation_key}.{self.domain}{port}"

    def holds(self, host_header: str) -> bool:
        """Whether a request's Host is under the apps domain (an app's, or a malformed one):
        such a request is never the portal's."""
        host = split_domain_port(host_header.lower())[0] or host_header.lower().rsplit(":", 1)[0]
        return host == self.domain or host.endswith("." + self.domain)

    def label(self, host_header: str) -> AppLabel | None:
        """The sandbox an app origin's Host names; None for any other host."""
        host = split_domain_port(host_header.lower())[0]
        suffix = "." + self.domain
        if not host.endswith(suffix):
            return None
        found = _LABEL.fullmatch(host[: -len(suffix)])
        if found is None:
            return None
        return AppLabel(int(found["sandbox"]), found["key"])

    def overlaps(self, allowed_hosts: list[str], trusted_origins: list[str]) -> str:
        """Why the portal's own settings would let it answer, or trust, an app's origin; ''
        when they do not. An app's host in ALLOWED_HOSTS would make the portal's pages and
        sockets answer there; in CSRF_TRUSTED_ORIGINS, trust its forms and sockets."""
        probe = f"0-{'0' * 32}.{self.domain}"
        if validate_host(probe, allowed_hosts):
            return f"ALLOWED_HOSTS ({', '.join(allowed_hosts)}) matches the apps' hosts ({probe})"
        for origin in trusted_origins:
            # Django reads a leading "*." as any subdomain; otherwise the host exactly.
            host = origin.lower().partition("://")[2].split("/")[0].rsplit(":", 1)[0]
            wildcard = host.startswith("*.")
            if probe == host or (wildcard and probe.endswith(host[1:])):
                return f"CSRF_TRUSTED_ORIGINS entry {origin} matches the apps' hosts"
        return ""
