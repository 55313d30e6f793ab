"""API tokens, self-service, from both sides: the owner makes one on the page and sees its key
once; nobody else can see or revoke it; staff revoke anyone's; no path makes a token without
a key; an expired or revoked token is a 401 at once; creation and revocation are audited."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.sites import site
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.audit.models import AuditEntry
from tests.portal.helpers import client_for

pytestmark = pytest.mark.django_db
KEY = re.compile(r'<code class="key" id="new-key">(gps_[A-Za-z0-9_-]+)</code>')


def make(client: Client, **fields: Any) -> Any:
    body = {"name": "billing-export", "scopes": ["read:usage"], "expiry_days": "30", **fields}
    return client.post("/account/tokens/", body)


def test_a_user_makes_a_token_sees_its_key_once_and_it_works(people: Any) -> None:
    page = client_for(people["owner"])
    made = make(page)
    assert made.status_code == 200 and "no-store" in made["Cache-Control"]
    key = KEY.search(made.content.decode()).group(1)  # type: ignore[union-attr]
    token = ApiToken.objects.get(user=people["owner"])
    assert token.scopes == ["read:usage"] and token.key_hash != key and key.startswith(token.key_prefix)
    assert timedelta(days=29) < token.expires_at - timezone.now() <= timedelta(days=30)  # type: ignore[operator]
    assert Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    again = page.get("/account/tokens/").content.decode()
    assert key not in again and f"{token.key_prefix}…" in again  # listed, never shown again
    assert key not in str(dict(page.session))


def test_revoked_and_expired_tokens_are_refused_at_once(people: Any) -> None:
    page = client_for(people["owner"])
    key = KEY.search(make(page).content.decode()).group(1)  # type: ignore[union-attr]
    token = ApiToken.objects.get(user=people["owner"])
    assert page.post(f"/account/tokens/{token.pk}/revoke/").status_code == 302
    refused = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    _old, old_key = ApiToken.issue(people["owner"], "old", ["read:usage"], expires_at=timezone.now())
    expired = Client().get("/api/v1/usage/", HTTP_AUTHORIZATION=f"Bearer {old_key}")
    assert expired.status_code == 401 and "expired" in expired.json()["detail"]


def test_nobody_else_sees_or_revokes_my_token(people: Any) -> None:
    make(client_for(people["owner"]))
    token = ApiToken.objects.get(user=people["owner"])
    for persona in ("member", "outsider"):
        other = client_for(people[persona])
        assert token.key_prefix not in other.get("/account/tokens/").content.decode()
        assert other.post(f"/account/tokens/{token.pk}/revoke/").status_code == 404
    token.refresh_from_db()
    assert token.revoked_at is None


def test_staff_see_and_revoke_anyones_token_and_both_are_audited(people: Any) -> None:
    make(client_for(people["owner"]))
    token = ApiToken.objects.get(user=people["owner"])
    admin = client_for(people["admin"])
    assert token.key_prefix in admin.get("/account/tokens/").content.decode()
    assert admin.post(f"/account/tokens/{token.pk}/revoke/").status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None and token.revoked_by == people["admin"]
    actions = list(
        AuditEntry.objects.filter(target_type="accounts.apitoken", target_id=str(token.pk))
        .order_by("pk")
        .values_list("actor_name", "action")
    )
    assert actions == [("olivia", "api_token.created"), ("ada", "api_token.revoked")]
    assert "key_hash" not in str(AuditEntry.objects.values_list("after", flat=True))


def test_only_staff_may_give_a_token_the_admin_scope(people: Any) -> None:
    refused = make(client_for(people["owner"]), scopes=["admin"])
    assert refused.status_code == 400 and not ApiToken.objects.exists()
    assert make(client_for(people["admin"]), scopes=["admin", "read:usage"]).status_code == 200
    assert ApiToken.objects.get().scopes == ["admin", "read:usage"]


@pytest.mark.parametrize(
    "fields",
    [
        {"name": ""},
        {"name": "x" * 101},
        {"name": "a\x00b"},
        {"name": "\u202egnp.exe"},
        {"scopes": []},
        {"scopes": ["root"]},
        {"expiry_days": "0"},
        {"expiry_days": "3650"},
        {"expiry_days": "²"},
        {"privileged": "1"},
    ],
)
def test_bad_token_forms_are_form_errors(people: Any, fields: dict[str, Any]) -> None:
    response = make(client_for(people["owner"]), **fields)
    assert response.status_code == 400 and not ApiToken.objects.exists()


def test_no_way_is_left_to_make_a_token_without_a_key(people: Any) -> None:
    """The admin offered an add form that saved an empty key hash (and a second one was a
    500 on the unique index); the database now refuses such a row whoever writes it."""
    request = type("R", (), {"user": people["admin"]})()
    assert site._registry[ApiToken].has_add_permission(request) is False
    admin = client_for(people["admin"])
    assert admin.get("/admin/accounts/apitoken/add/").status_code == 403
    with pytest.raises(IntegrityError), transaction.atomic():
        ApiToken.objects.create(user=people["owner"], name="keyless", key_hash="", key_prefix="")


def test_the_admin_revokes_through_the_audited_path(people: Any) -> None:
    token, _key = ApiToken.issue(people["owner"], "ci", ["read:usage"])
    admin = client_for(people["admin"])
    answer = admin.post(
        "/admin/accounts/apitoken/", {"action": "revoke", "_selected_action": [token.pk]}, follow=True
    )
    assert answer.status_code == 200 and "1 tokens revoked" in answer.content.decode()
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert AuditEntry.objects.filter(action="api_token.revoked", target_id=str(token.pk)).exists()


def test_the_last_use_is_written_once_a_minute_not_once_a_request(people: Any) -> None:
    """A script's burst of requests wrote its token's row once each, queueing for SQLite's one
    writer with the requests' own work; the page shows the last use to the minute anyway."""
    token, key = ApiToken.issue(people["owner"], "burst", ["read:usage"])
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.get("/api/v1/usage/").status_code == 200
    token.refresh_from_db()
    first = token.last_used_at
    assert first is not None
    assert client.get("/api/v1/usage/").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at == first  # within the minute: not written again
    a_minute_ago = first - timedelta(minutes=1)
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=a_minute_ago)
    assert client.get("/api/v1/usage/").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None and token.last_used_at > a_minute_ago
