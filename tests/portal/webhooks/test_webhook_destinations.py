"""Where webhooks may go (portal/webhooks/destinations.py), from the outside review's side: a
302 once sent the control worker, signature headers and all, to another port, and endpoints
on loopback, link-local and metadata addresses were accepted. Real HTTP(S) servers on
loopback; only a rebinding DNS server, which cannot exist here, is played by the resolver."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from portal.webhooks import deliveries
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint
from tests.portal.helpers import client_for

pytestmark = pytest.mark.django_db


class Server:
    """An HTTP server on ``address`` recording every request, whatever its method, and
    answering ``status`` with ``headers``."""

    def __init__(
        self, address: str = "127.0.0.1", port: int = 0, status: int = 200, tls: ssl.SSLContext | None = None
    ) -> None:
        self.status, self.headers = status, dict[str, str]()
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.received.append((self.command, headers, self.rfile.read(size)))
                self.send_response(server.status)
                for name, value in server.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = do_PUT = _record

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((address, port), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


def allow(settings: Any, *networks: str) -> None:
    settings.WEBHOOK_ALLOWED_NETWORKS = tuple(ipaddress.ip_network(n) for n in networks)


def deliver_to(url: str) -> WebhookDelivery:
    """One delivery to ``url`` (saved as a row already there would be: no form), attempted."""
    endpoint = WebhookEndpoint.objects.create(url=url, events=["usage.closed"])
    delivery = WebhookDelivery.objects.create(
        endpoint=endpoint,
        event="usage.closed",
        event_id=deliveries.event_uuid(url),
        payload={"n": 1},
        next_attempt_at=timezone.now(),
    )
    deliveries.attempt_delivery(delivery.pk)
    delivery.refresh_from_db()
    return delivery


@pytest.mark.parametrize("redirect", [302, 307])
def test_a_redirect_is_not_followed(settings: Any, servers: list[Server], redirect: int) -> None:
    """A 302 (which urllib followed as a GET, headers and all) or a 307 (re-POSTed, body and
    signature): the second server gets nothing; the delivery failed with the status and is
    retried like any 4xx or 5xx, always to the endpoint's own URL."""
    allow(settings, "127.0.0.0/8")
    elsewhere = Server()
    redirecting = Server(status=redirect)
    servers += [elsewhere, redirecting]
    redirecting.headers["Location"] = f"http://127.0.0.1:{elsewhere.port}/stolen"
    delivery = deliver_to(f"http://127.0.0.1:{redirecting.port}/hooks")
    assert elsewhere.received == []
    [(method, headers, _body)] = redirecting.received
    assert method == "POST" and headers["webhook-signature"].startswith("v1,")
    assert delivery.last_status == redirect and delivery.status == "pending" and delivery.attempts == 1
    assert delivery.last_error == f"HTTP {redirect}: redirects are not followed"
    assert delivery.attempt_log[-1]["status"] == redirect


REFUSED = {
    "http://127.0.0.1/": "127.0.0.1 is a loopback address",
    "http://localhost:8080/hook": "localhost resolves to ",  # by name: what it resolves to counts
    "http://169.254.169.254/latest/meta-data/": "169.254.169.254 is a link-local address",
    "http://10.1.2.3/": "10.1.2.3 is a private address",
    "https://192.168.0.10/": "192.168.0.10 is a private address",
    "http://100.64.0.1/": "100.64.0.1 is a non-global address",
    "http://0.0.0.0:80/": "0.0.0.0 is an unspecified address",
    "http://224.0.0.1/": "224.0.0.1 is a multicast address",
    "http://[::1]/": "::1 is a loopback address",
    "http://[fe80::1]/": "fe80::1 is a link-local address",
    "http://[fd00:ec2::254]/": "fd00:ec2::254 is a private address",
    "http://[ff02::1]/": "ff02::1 is a multicast address",
    "http://[::]/": ":: is an unspecified address",
    "http://[::ffff:127.0.0.1]/": "::ffff:127.0.0.1 is a loopback address (127.0.0.1)",
    "http://[::ffff:169.254.169.254]/": "::ffff:169.254.169.254 is a link-local address (169.254.169.254)",
}


@pytest.mark.parametrize("url", list(REFUSED))
def test_an_endpoint_on_a_non_public_address_is_refused_when_saved(url: str) -> None:
    with pytest.raises(ValidationError) as refused:
        WebhookEndpoint(url=url, events=["usage.closed"]).full_clean()
    [message] = refused.value.message_dict["url"]
    assert message.startswith(REFUSED[url]) and "WEBHOOK_ALLOWED_NETWORKS" in message, message
    assert set(refused.value.message_dict) == {"url"}


def test_allowed_networks_and_public_addresses_may_be_saved(settings: Any) -> None:
    WebhookEndpoint(url="https://8.8.8.8/hooks", events=["usage.closed"]).full_clean()  # public
    allow(settings, "10.0.0.0/8", "fd00::/8")
    for url in ("http://10.1.2.3/", "http://[fd00:ec2::254]/", "http://[::ffff:10.0.0.1]/"):
        WebhookEndpoint(url=url, events=["usage.closed"]).full_clean()
    with pytest.raises(ValidationError):  # what is not listed stays refused
        WebhookEndpoint(url="http://169.254.169.254/", events=["usage.closed"]).full_clean()


def test_the_admin_form_names_the_url_field(people: Any) -> None:
    """Refused, malformed or not http(s): an error on the URL field, never a 500."""
    admin = client_for(people["admin"])
    add = reverse("admin:webhooks_webhookendpoint_add")
    fields = {"events": '["usage.closed"]', "secret": "whsec_" + "A" * 44, "active": "on",
              "created_at_0": "2026-01-01", "created_at_1": "00:00:00"}  # fmt: skip
    for url in ("http://169.254.169.254/latest/meta-data/", "localhost", "http://[::1", "ftp://8.8.8.8/"):
        page = admin.post(add, {**fields, "url": url})
        assert page.status_code == 200, url
        errors = page.context["adminform"].form.errors
        assert set(errors) == {"url"}, (url, errors)
    page = admin.post(add, {**fields, "url": "http://169.254.169.254/latest/meta-data/"})
    assert "169.254.169.254 is a link-local address" in page.content.decode()
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_delivery_refuses_a_loopback_receiver(servers: list[Server], host: str) -> None:
    """A row saved before the check (or by hand) is checked again when delivered: nothing
    is sent, and no retry is scheduled, as the same checks would refuse it again."""
    receiver = Server()
    servers.append(receiver)
    delivery = deliver_to(f"http://{host}:{receiver.port}/hooks")
    assert receiver.received == []
    assert delivery.status == "failed" and delivery.attempts == 1 and delivery.last_status is None
    assert delivery.last_error.startswith("refused: ") and "loopback address" in delivery.last_error


def test_a_rebinding_name_reaches_only_the_address_that_was_checked(
    settings: Any, servers: list[Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DNS server answering an allowed address to the check and loopback to the connection
    (rebinding) gets one question: the connection goes to the address checked."""
    allow(settings, "127.0.0.2/32")
    checked = Server("127.0.0.2")
    forbidden = Server("127.0.0.1", port=checked.port)  # the same port, on a refused address
    servers += [checked, forbidden]
    answers = iter(["127.0.0.2", "127.0.0.1", "127.0.0.1"])
    real_getaddrinfo = socket.getaddrinfo

    def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "rebind.test":
            return real_getaddrinfo(next(answers), port, *args, **kwargs)
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    delivery = deliver_to(f"http://rebind.test:{checked.port}/hooks")
    assert delivery.status == "delivered"
    assert forbidden.received == []
    [(_method, headers, _body)] = checked.received
    assert headers["host"] == f"rebind.test:{checked.port}"  # the name, not the address


@pytest.fixture
def localhost_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context with a self-signed certificate for the name localhost only (no IP),
    which the portal's TLS trusts through SSL_CERT_FILE, as an operator's private CA would be."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def test_https_keeps_sni_and_the_certificate_check_for_the_name(
    settings: Any, servers: list[Server], localhost_certificate: ssl.SSLContext
) -> None:
    allow(settings, "127.0.0.0/8", "::1/128")
    names: list[str | None] = []
    localhost_certificate.sni_callback = lambda _sock, name, _ctx: names.append(name)
    receiver = Server(tls=localhost_certificate)
    servers.append(receiver)
    delivered = deliver_to(f"https://localhost:{receiver.port}/hooks")
    assert delivered.status == "delivered", delivered.last_error
    assert names == ["localhost"] and receiver.received[0][1]["host"] == f"localhost:{receiver.port}"
    # The same server by its address: the certificate names localhost, not 127.0.0.1.
    by_address = deliver_to(f"https://127.0.0.1:{receiver.port}/hooks")
    assert by_address.status == "pending" and "certificate" in by_address.last_error.lower()
    assert len(receiver.received) == 1
