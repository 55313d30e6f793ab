"""Where a webhook may go: public addresses only, unless the operator lets a network through
(``WEBHOOK_ALLOWED_NETWORKS``), and never where a redirect points.

A webhook is a POST the control worker makes, from inside the operator's network, to a URL
someone typed. Left alone it reaches what only that network reaches: the portal's own
services on loopback, the cloud's metadata service (169.254.169.254), hosts on private
networks. So the URL is checked twice:

- when an endpoint is saved (``url_problem``, from ``WebhookEndpoint.clean``: the admin
  form's error on the URL field), to say so early;
- at each delivery (``post``), which is what holds: a name that resolved to a public address
  when saved may resolve to loopback now. The name is resolved once, every address it gives
  is checked (one refused address refuses the delivery: a name with a foot inside is not
  trusted with the other), and the connection goes to a checked address, never to a second
  resolution a rebinding DNS server could answer differently. The request still carries the
  name: in the Host header, in TLS's SNI, and in the certificate check.

No redirect is followed (``http.client`` follows none): a 3xx is the receiver's answer, a
failed delivery like a 4xx, so a receiver cannot send the signed request on to a place the
checks never saw.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import SplitResult, urlsplit

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
SockAddr = tuple[Any, ...]

# IPv6 forms that carry an IPv4 address a router may deliver to: IPv4-mapped
# (::ffff:a.b.c.d, which a dual-stack socket connects to over IPv4), the deprecated
# IPv4-compatible ::a.b.c.d, NAT64's well-known prefix and 6to4.
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class RefusedDestination(Exception):
    """The URL leads somewhere webhooks may not go (a message for the admin and the log)."""


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):  # not :: nor ::1
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _kind(address: IPAddress) -> str | None:
    """What makes ``address`` no public one ("a loopback address"; None: it is public)."""
    for label, test in (
        ("a loopback", address.is_loopback),
        ("a link-local", address.is_link_local),  # the metadata service, 169.254.169.254
        ("a multicast", address.is_multicast),
        ("an unspecified", address.is_unspecified),
        ("a private", address.is_private),  # RFC 1918, unique-local fc00::/7, and the like
        ("a non-global", not address.is_global),  # shared (CGNAT), reserved, documentation
    ):
        if test:
            return f"{label} address"
    return None


def refusal(address: IPAddress) -> str | None:
    """Why a webhook may not connect to ``address`` ("a loopback address"), or None when it
    may: a public address, or one in WEBHOOK_ALLOWED_NETWORKS. An IPv6 address carrying an
    IPv4 one is judged by that too (::ffff:127.0.0.1 is loopback)."""
    inner = _embedded_ipv4(address)
    allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = settings.WEBHOOK_ALLOWED_NETWORKS
    if any(address in net or (inner is not None and inner in net) for net in allowed):
        return None
    if inner is not None and (kind := _kind(inner)):
        return f"{kind} ({inner})"
    return _kind(address)


def _split(url: str) -> tuple[SplitResult, str, int]:
    """The URL's parts, host and port; RefusedDestination when it is no http(s) URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedDestination(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RefusedDestination("a webhook URL starts with http:// or https:// and names a host")
    return parts, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve(host: str, port: int) -> list[tuple[int, SockAddr]]:
    """Every address ``host`` has now, each checked: RefusedDestination if any is refused,
    OSError when the name does not resolve."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except UnicodeError as exc:  # a label longer than DNS allows
        raise OSError(f"cannot resolve {host}: {exc}") from None
    addresses: list[tuple[int, SockAddr]] = [(family, sockaddr) for family, _t, _p, _n, sockaddr in found]
    for _family, sockaddr in addresses:
        # A scoped IPv6 address comes back as "fe80::1%eth0": the scope is not part of it.
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        why = refusal(address)
        if why is not None:
            said = f"{host} is {why}" if _is_address(host) else f"{host} resolves to {address}, {why}"
            raise RefusedDestination(f"{said}: not for webhooks unless WEBHOOK_ALLOWED_NETWORKS allows it")
    if not addresses:
        raise OSError(f"{host} has no address")
    return addresses


def url_problem(url: str) -> str | None:
    """Why an endpoint may not be saved with ``url``, or None. A name that does not resolve
    now is let through: its receiver may not exist yet, and every delivery checks again."""
    try:
        _parts, host, port = _split(url)
        resolve(host, port)
    except RefusedDestination as exc:
        return str(exc)
    except OSError:
        pass
    return None


def _connect_first(addresses: list[tuple[int, SockAddr]], timeout: float) -> socket.socket:
    """A TCP connection to the first checked address that answers (as
    ``socket.create_connection`` tries a name's addresses, without resolving it again)."""
    error: OSError = OSError("no address")
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


class _CheckedHTTPConnection(http.client.HTTPConnection):
    """HTTP to ``host`` (its Host header) over a connection to a checked address."""

    def __init__(self, host: str, port: int, addresses: list[tuple[int, SockAddr]], timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.addresses, self.connect_timeout = addresses, timeout

    def connect(self) -> None:
        self.sock = _connect_first(self.addresses, self.connect_timeout)


class _CheckedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS likewise: the TLS handshake sends ``host`` as SNI and checks the certificate
    against it (the default context: system CAs, hostname checked)."""

    def __init__(self, host: str, port: int, addresses: list[tuple[int, SockAddr]], timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self.tls)
        self.addresses, self.connect_timeout = addresses, timeout

    def connect(self) -> None:
        sock = _connect_first(self.addresses, self.connect_timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


def post(url: str, data: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST ``data`` to ``url`` through the checks above; the answer's status, whatever it is
    (a redirect is not followed). RefusedDestination, or OSError (http.client's errors
    included) when nothing was answered."""
    parts, host, port = _split(url)
    addresses = resolve(host, port)
    connection_class = _CheckedHTTPSConnection if parts.scheme == "https" else _CheckedHTTPConnection
    connection = connection_class(host, port, addresses, timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("POST", target, body=data, headers=headers)
        return connection.getresponse().status
    except http.client.HTTPException as exc:  # a malformed answer: no status to record
        raise OSError(f"bad HTTP answer: {exc!r}") from exc
    finally:
        connection.close()
