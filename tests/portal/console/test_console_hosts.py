"""Console → Hosts (issue 38, enrolment): admins issue, rotate and revoke a host's credentials
from the portal, as ``manage.py host_credential`` does; the secrets are shown once."""

from __future__ import annotations

import html
import re
from types import SimpleNamespace
from typing import Any

import pytest

from portal.audit.models import AuditEntry
from portal.fleet import credentials
from portal.fleet.models import HostCredential
from portal.telemetry.models import Alert
from tests.conftest import seed_host
from tests.portal.helpers import client_for
from wire import signing

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_redis_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ACL users are test_host_credentials.py's; here, what the page does with them."""
    monkeypatch.setattr(credentials, "_apply", lambda *a, **k: None)
    monkeypatch.setattr(credentials, "_admin", lambda: SimpleNamespace(execute_command=lambda *a: None))


def shown(page: Any) -> dict[str, str]:
    """The files the issued page shows: name -> value."""
    text = page.content.decode()
    names = re.findall(r"<code>/etc/gpushare/credentials/([a-z_.]+)</code>", text)
    values = [html.unescape(v) for v in re.findall(r"<textarea[^>]*>([^<]*)</textarea>", text)]
    return dict(zip(names, values, strict=True))


def test_an_admin_enrols_rotates_and_revokes_a_host(people: Any) -> None:
    seed_host("gpu01", "A100-80GB:1")
    admin = client_for(people["admin"])
    listing = admin.get("/console/hosts/")
    assert listing.status_code == 200 and b"gpu01" in listing.content and b"Not enrolled" in listing.content

    issued = admin.post("/console/hosts/issue/", {"host": "gpu01"})
    assert issued.status_code == 200 and "no-store" in issued["Cache-Control"]
    files = shown(issued)
    assert sorted(files) == ["control_key.pub", "host_key", "redis_url"]
    assert files["control_key.pub"] == credentials.control_public_key()
    public = signing.public_text(signing.private_key(files["host_key"]))
    assert HostCredential.objects.get(host="gpu01").signing_key == public
    # Shown once: the list never carries them again.
    again = admin.get("/console/hosts/").content.decode()
    assert files["host_key"] not in again and "gpushare-host-gpu01:" not in again

    rotated = shown(admin.post("/console/hosts/gpu01/rotate/"))
    assert rotated["host_key"] != files["host_key"]
    revoked = admin.post("/console/hosts/gpu01/revoke/", follow=True)
    assert b"revoked" in revoked.content
    assert not HostCredential.objects.get(host="gpu01").active
    actions = list(
        AuditEntry.objects.filter(target_type="fleet.hostcredential").values_list("action", flat=True)
    )
    assert sorted(actions) == ["credential issued", "credential revoked", "credential rotated"]
    assert not any(files["host_key"] in str(e.after) for e in AuditEntry.objects.all())


def test_bad_input_is_a_form_error_and_outsiders_are_turned_away(people: Any) -> None:
    admin = client_for(people["admin"])
    bad = admin.post("/console/hosts/issue/", {"host": "a b*"})
    assert bad.status_code == 400 and b"is not a host name" in bad.content
    admin.post("/console/hosts/issue/", {"host": "gpu02"})
    twice = admin.post("/console/hosts/issue/", {"host": "gpu02"})
    assert twice.status_code == 400 and b"already has a credential" in twice.content
    gone = admin.post("/console/hosts/nowhere/revoke/", follow=True)
    assert b"no active credential" in gone.content
    member = client_for(people["member"])
    assert member.get("/console/hosts/").status_code == 302
    assert member.post("/console/hosts/issue/", {"host": "gpu03"}).status_code == 302
    assert not HostCredential.objects.filter(host="gpu03").exists()
    assert admin.get("/console/hosts/issue/").status_code == 405


def test_a_host_that_forged_shows_its_open_alerts(people: Any) -> None:
    seed_host("gpu04", "A100-80GB:1")
    client_for(people["admin"]).post("/console/hosts/issue/", {"host": "gpu04"})
    from portal.fleet.models import Host
    from portal.telemetry.alerts import do_raise_forgery_alert

    do_raise_forgery_alert(
        Host.objects.get(name="gpu04"), "forged:gpu04:x", "agent_heartbeats from host:gpu04 dropped"
    )
    page = client_for(people["admin"]).get("/console/hosts/")
    assert b"1 open alert" in page.content
    assert Alert.objects.filter(kind="forged").count() == 1
