"""SSH keys on an account (portal/accounts/ssh_keys.py): each key read whole as OpenSSH would,
refused with the reason when it is not a public key of a type and size gpushare takes; the
fingerprint ``ssh-keygen -l`` shows; the API and the account page, each user's own keys only,
from the outsider's side too. (The keys of real ``ssh-keygen`` runs, kept here.)"""

from __future__ import annotations

import base64
import struct
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken, SshKey
from portal.accounts.ssh_keys import SshKeyError, do_add_key, offered_keys, parse_public_key
from portal.audit.models import AuditEntry
from tests.portal.helpers import client_for
from wire.ssh import bare_key

pytestmark = pytest.mark.django_db
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA0EakXojEzSDFAISLn4t0CKUiHj4Xous65ZINhXhetj olivia@laptop"
ED25519_FINGERPRINT = "SHA256:6ex8cP4PKZP5sOHJmrYncAaSbOvxIGUErgw4aRElk3E"
ECDSA = (
    "ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBGgsUOlmjDGV9ZL+eGQ9h0tUEba"
    "dt2eR84oOH+kEHP8NVGzbLpgkzsVhxILWerDzS/+uRXtgrbtQ/HQO2pTGEXdH/6pnVCX/8Qag4hm1nZNeMQa5YEwJEQ3KuGC7V"
    "mR0Cg== ec"
)
# A FIDO ECDSA key as ssh-keygen -t ecdsa-sk writes it (type, curve, point, application "ssh:"),
# its point P-256's generator; ssh-keygen -l reads it and gave this fingerprint.
SK_ECDSA = (
    "sk-ecdsa-sha2-nistp256@openssh.com AAAAInNrLWVjZHNhLXNoYTItbmlzdHAyNTZAb3BlbnNzaC5jb20AAAAIbmlzdHAyNTYA"
    "AABBBGsX0fLhLEJH+Lzm5WOkQPJ3A32BLeszoPShOUXYmMKWT+NC4v4af5uO5+tKfA+eFivOM1drMV7Oy7ZAaDe/UfUAAAAEc3NoOg=="
    " yubikey"
)
SK_ECDSA_TYPE = b"sk-ecdsa-sha2-nistp256@openssh.com"
RSA_2048 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC4EADcZfhKov1rJckYKARfN6XB3Tf+bI5HTvDVfaTklnT30QM2Fu0IYjnP6tp7LQqp"
    "QnKvgHaRgLAywFbr8r5CQ/7uEstDS9P3fir5IJgsUiBLEpZx6hodh391SqXveARSVKJvZ89nxpLR51Yo9C49h8e0fgsfb99FNQzizJeNFoB"
    "BSL80lpcaiGOSkBNLZww2z420d9ZdiPzfZqQAzyy12GLzJipx3n8gJhWyFhW4px6oYPxVEse9B4KA/oiEnfRB4qQ8aLknrcwBTfHdQ8p46Q4"
    "i67KTMF4yGSCvPyMukt6fOQO+y5uiZ0c5M6g1sZaChV7queOrJCDHaqaplOzX old"
)
RSA_3072 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQCiaOMpOd4QOhJXvNpLLLYNp+yC5ngJ/8HPDZ12G9wHtBWyBA/VRaqL7YhonRuKopEf"
    "y6kGTpbR69+btC2XCBKY0wBLyZ3fQKyr7P7wVGkdVvYOx8FynLHZDumk8tN/6j7BjDjIUgULPrF0KePqJ5wE5m/3bkhjoQZxWm+qxwxriu"
    "bXUkKusG0ETJfl8jqtq8AIdYu+6dUtOoLi8tHaHzAWpj9j0UUrQ1P1nJP6nJ0boo9uqK+Vavw0ZVcsT03Uz+XpURuwMzlArsxZA3ctvHsw0"
    "7sfoVw+QbFD38xolznnCWS8dC71vUKgat+oP3TqBC+vv4rKhBvXR59r/HkgprurRwMMrjejqxIWUdbpIX29raItYmIXHpq8QIJL1o5xtVer"
    "DgxFMaX14yI/5ZM2QlSYMa+KIsKWmHaq0BIWWM8RkIFNH0wq/ga42FxY0zbuhb/igV9X0YoSCEOG//1H1B/8i8vw9zxDrErRfT/pNbRSnVbJ"
    "G5QXiOyPZIqLr8xOa6c= rsa"
)


def _blob(*fields: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(f)) + f for f in fields)).decode()


# --- what a key is ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits", "fingerprint"),
    [
        (ED25519, 256, ED25519_FINGERPRINT),
        (ECDSA, 384, "SHA256:Fa5SZdBnf54tzzh3MQ6x8seMorZ2nGfU5gT9XZsbnlw"),
        (RSA_3072, 3072, "SHA256:ZmTV+ig6tJzGfa89hFlCNn/RbxPpFz7sor3ob5YrcTQ"),
        (SK_ECDSA, 256, "SHA256:Sq6FPgsPWZc3RXSXKFq4uzEhPEwaHZCAoX46/7Q5024"),
    ],
)
def test_a_public_key_is_read_whole_with_ssh_keygens_fingerprint(
    text: str, bits: int, fingerprint: str
) -> None:
    key = parse_public_key(f"  {text}\n")
    assert (key.bits, key.fingerprint) == (bits, fingerprint)
    assert key.bare == " ".join(text.split()[:2]) and bare_key(key.bare) == key.bare
    assert key.comment == text.split()[2]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "Paste your public key"),
        (RSA_2048, "This RSA key has 2048 bits: use 3072 or more"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP== x", "Not a public key of a supported type"),
        (f'command="rm -rf /" {ED25519}', "Not a public key of a supported type"),  # options
        (f"{ED25519}\n{ECDSA}", "Paste one key, on one line."),
        ("-----BEGIN OPENSSH PRIVATE KEY-----", "This is a private key"),
        ("ssh-ed25519 not!base64", "The key's base64 part does not decode."),
        (f"ssh-ed25519 {_blob(b'ssh-rsa', b'x' * 32)}", "The key says it is ssh-ed25519 but"),
        (f"ssh-ed25519 {_blob(b'ssh-ed25519', b'x' * 31)}", "An Ed25519 key is 32 bytes"),
        (f"ssh-ed25519 {_blob(b'ssh-ed25519', b'x' * 32, b'more')}", "The key has bytes after its end"),
        (f"ssh-ed25519 {_blob(b'ssh-ed25519')}", "The key is cut short"),
        (
            "ecdsa-sha2-nistp256 " + _blob(b"ecdsa-sha2-nistp256", b"nistp384", bytes(65)),
            "The key's curve or point",
        ),
        (f"ssh-ed25519 {'A' * 5000}", "The key is longer than any supported key."),
        # A curve no table names (the type's word that once was taken for it): refused, no KeyError.
        (f"{SK_ECDSA_TYPE.decode()} {_blob(SK_ECDSA_TYPE, b'sha2', bytes(65), b'ssh:')}", "The key's curve"),
        (
            f"{SK_ECDSA_TYPE.decode()} {_blob(SK_ECDSA_TYPE, b'nistp384', bytes(97), b'ssh:')}",
            "The key's curve",
        ),
    ],
)
def test_what_is_not_a_key_is_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(SshKeyError) as refused:
        parse_public_key(text)
    assert refused.value.message.startswith(says), refused.value.message


def test_a_key_goes_on_an_account_once_named_by_its_comment_and_audited(people: Any) -> None:
    key = do_add_key(people["owner"], "", ED25519)
    assert (key.name, key.fingerprint, key.key_type) == ("olivia@laptop", ED25519_FINGERPRINT, "ssh-ed25519")
    with pytest.raises(SshKeyError, match="already on your account"):
        do_add_key(people["owner"], "again", ED25519)
    do_add_key(people["member"], "mark's copy", ED25519)  # another account may hold it too
    assert AuditEntry.objects.filter(action="ssh_key.added", actor=people["owner"]).count() == 1


def test_a_connection_is_offered_its_users_keys_alone_and_marks_them(people: Any) -> None:
    do_add_key(people["owner"], "laptop", ED25519)
    do_add_key(people["owner"], "desk", ECDSA)
    do_add_key(people["member"], "", RSA_3072)
    assert sorted(offered_keys(people["owner"])) == sorted(" ".join(k.split()[:2]) for k in (ED25519, ECDSA))
    assert offered_keys(people["outsider"]) == []
    assert SshKey.objects.filter(user=people["owner"], last_offered_at__isnull=True).count() == 0
    assert SshKey.objects.get(user=people["member"]).last_offered_at is None


# --- the API ----------------------------------------------------------------------------------


def _api(user: Any, scopes: list[str]) -> Client:
    _, key = ApiToken.issue(user, "cli", scopes, timezone.now() + timedelta(days=1))
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def _post(api: Client, body: dict[str, Any]) -> Any:
    return api.post("/api/v1/ssh-keys/", body, content_type="application/json")


def test_the_api_lists_adds_and_removes_your_own_keys(people: Any) -> None:
    api = _api(people["owner"], ["write:sandboxes"])
    added = _post(api, {"public_key": ED25519})
    assert added.status_code == 201, added.content
    body = added.json()
    assert body["fingerprint"] == ED25519_FINGERPRINT and body["name"] == "olivia@laptop"
    assert body["public_key"] == " ".join(ED25519.split()[:2]) and body["last_offered_at"] is None
    again = _post(api, {"public_key": ED25519})
    assert again.status_code == 400
    assert again.json() == {"public_key": ["This key is already on your account."]}
    weak = _post(api, {"public_key": RSA_2048, "name": "old"})
    assert weak.status_code == 400 and "2048 bits" in weak.json()["public_key"][0]
    assert _post(api, {"public_key": ECDSA, "force": True}).status_code == 400  # no unknown field
    listed = api.get("/api/v1/ssh-keys/").json()
    assert [k["fingerprint"] for k in listed["results"]] == [ED25519_FINGERPRINT]
    assert api.delete(f"/api/v1/ssh-keys/{body['id']}/").status_code == 204
    assert api.get("/api/v1/ssh-keys/").json()["results"] == []
    assert AuditEntry.objects.filter(action="ssh_key.removed").count() == 1


CRAFTED_CURVE = f"{SK_ECDSA_TYPE.decode()} {_blob(SK_ECDSA_TYPE, b'sha2', bytes(65), b'ssh:')}"


def test_a_fido_ecdsa_key_is_taken_and_a_crafted_curve_refused_not_a_500(people: Any) -> None:
    api = _api(people["owner"], ["write:sandboxes"])
    crafted = _post(api, {"public_key": CRAFTED_CURVE})
    assert crafted.status_code == 400, crafted.content
    assert list(crafted.json()) == ["public_key"] and "curve or point" in crafted.json()["public_key"][0]
    page = client_for(people["owner"]).post("/account/ssh-keys/", {"public_key": CRAFTED_CURVE})
    assert page.status_code == 400 and "public_key" in page.context["form"].errors
    assert "curve or point does not match" in page.content.decode()
    added = _post(api, {"public_key": SK_ECDSA})
    assert added.status_code == 201, added.content
    assert added.json()["public_key"] == " ".join(SK_ECDSA.split()[:2]) and added.json()["name"] == "yubikey"


def test_the_api_is_the_callers_own_and_needs_the_write_scope(people: Any) -> None:
    mine = do_add_key(people["member"], "mark", ED25519)
    for persona in ("outsider", "owner"):  # another tenant; a manager of mark's project
        other = _api(people[persona], ["write:sandboxes", "read:usage"])
        assert other.get("/api/v1/ssh-keys/").json()["results"] == []
        assert other.delete(f"/api/v1/ssh-keys/{mine.pk}/").status_code == 404
    admin = _api(people["admin"], ["admin"])
    assert admin.get("/api/v1/ssh-keys/").json()["results"] == []  # staff too: no one else's keys
    assert admin.delete(f"/api/v1/ssh-keys/{mine.pk}/").status_code == 404
    reader = _api(people["member"], ["read:usage"])
    assert reader.get("/api/v1/ssh-keys/").status_code == 403
    refused = _post(reader, {"public_key": ECDSA})
    assert refused.status_code == 403 and "write:sandboxes" in refused.json()["detail"]
    assert Client().get("/api/v1/ssh-keys/").status_code == 401
    assert SshKey.objects.filter(user=people["member"]).count() == 1


def test_the_api_documents_its_routes(people: Any) -> None:
    schema = client_for(people["owner"]).get("/api/schema/", {"format": "json"}).json()
    assert {"get", "post"} <= set(schema["paths"]["/api/v1/ssh-keys/"])
    assert "delete" in schema["paths"]["/api/v1/ssh-keys/{id}/"]


# --- the account page -------------------------------------------------------------------------


def test_the_page_adds_lists_and_removes_keys(people: Any) -> None:
    page = client_for(people["owner"])
    assert "No SSH keys." in page.get("/account/ssh-keys/").content.decode()
    refused = page.post("/account/ssh-keys/", {"public_key": RSA_2048})
    assert refused.status_code == 400 and "2048 bits" in refused.content.decode()
    added = page.post("/account/ssh-keys/", {"public_key": ED25519, "name": "laptop"}, follow=True)
    text = added.content.decode()
    assert f"SSH key laptop ({ED25519_FINGERPRINT}) is added." in text and "ssh-ed25519" in text
    key = SshKey.objects.get(user=people["owner"])
    assert client_for(people["outsider"]).post(f"/account/ssh-keys/{key.pk}/remove/").status_code == 404
    assert "No SSH keys." in client_for(people["outsider"]).get("/account/ssh-keys/").content.decode()
    removed = page.post(f"/account/ssh-keys/{key.pk}/remove/", follow=True)
    assert "is removed." in removed.content.decode() and not SshKey.objects.exists()
