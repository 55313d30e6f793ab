"""Password change and reset with Django's own views, the reset mail sent through a real SMTP
server on loopback (aiosmtpd: the ``smtp`` fixture, tests/portal/smtp.py) by the real SMTP
backend."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client, override_settings

from tests.portal.helpers import client_for
from tests.portal.smtp import Inbox

pytestmark = pytest.mark.django_db
NEW_PASSWORD = "a-new-long-passphrase-42"


def test_a_user_changes_their_password(people: Any) -> None:
    owner = client_for(people["owner"])
    page = owner.get("/account/password/")
    assert page.status_code == 200 and "Current password" in page.content.decode()
    wrong = owner.post("/account/password/", {"old_password": "nope", "new_password1": NEW_PASSWORD,
                                              "new_password2": NEW_PASSWORD})  # fmt: skip
    assert wrong.status_code == 200 and "incorrectly" in wrong.content.decode()
    from tests.conftest import PASSWORD

    done = owner.post("/account/password/", {"old_password": PASSWORD, "new_password1": NEW_PASSWORD,
                                             "new_password2": NEW_PASSWORD})  # fmt: skip
    assert done.status_code == 302 and done["Location"] == "/account/password/done/"
    people["owner"].refresh_from_db()
    assert people["owner"].check_password(NEW_PASSWORD)


def test_a_reset_link_arrives_by_smtp_and_sets_a_new_password(people: Any, smtp: Inbox) -> None:
    people["owner"].email = "olivia@example.test"
    people["owner"].save()
    browser = Client()
    asked = browser.post("/password-reset/", {"email": "olivia@example.test"})
    assert asked.status_code == 302 and asked["Location"] == "/password-reset/sent/"
    [(recipients, mail)] = smtp.messages
    assert recipients == ["olivia@example.test"] and mail["Subject"] == "gpushare: reset your password"
    link = re.search(r"http://localhost:8000(/password-reset/\S+/\S+/)", str(mail.get_payload())).group(1)  # type: ignore[union-attr]
    form = browser.get(link, follow=True)
    assert form.status_code == 200 and "Choose a new password" in form.content.decode()
    browser.post(form.redirect_chain[-1][0], {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    people["owner"].refresh_from_db()
    assert people["owner"].check_password(NEW_PASSWORD)
    again = browser.get(link, follow=True)
    assert "no longer works" in again.content.decode()  # a link works once


def test_the_reset_link_is_on_portal_url_whatever_the_host_header(
    people: Any, smtp: Inbox, settings: Any
) -> None:
    """Outside review: the link took the request's Host, and ALLOWED_HOSTS lets any port on
    the portal's name through, so an asker could point a victim's reset token at a port they
    listen on. The link's scheme, host and port are PORTAL_URL's."""
    settings.PORTAL_URL = "https://gpus.example.test:8443"
    people["owner"].email = "olivia@example.test"
    people["owner"].save()
    asked = Client().post("/password-reset/", {"email": "olivia@example.test"}, HTTP_HOST="testserver:4444")
    assert asked.status_code == 302
    [(_recipients, mail)] = smtp.messages
    body = str(mail.get_payload())
    link = re.compile(r"^https://gpus\.example\.test:8443/password-reset/\S+/\S+/\r?$", re.MULTILINE)
    assert link.search(body), body
    assert "4444" not in body and "testserver" not in body and "http://" not in body


def test_a_reset_does_not_say_whether_an_account_exists(people: Any, smtp: Inbox) -> None:
    answers = [Client().post("/password-reset/", {"email": e}) for e in ("nobody@example.test", "")]
    assert answers[0].status_code == 302 and answers[0]["Location"] == "/password-reset/sent/"
    assert answers[1].status_code == 200  # a form error, not a 500
    assert smtp.messages == []


def test_reset_requests_are_throttled_per_address(people: Any, smtp: Inbox) -> None:
    people["owner"].email = "olivia@example.test"
    people["owner"].save()
    with override_settings(PASSWORD_RESET_LIMIT=3):
        sent = [Client(REMOTE_ADDR="203.0.113.5").post("/password-reset/", {"email": "olivia@example.test"})
                for _ in range(4)]  # fmt: skip
        assert [r.status_code for r in sent] == [302, 302, 302, 429]
        other = Client(REMOTE_ADDR="198.51.100.1").post("/password-reset/", {"email": "olivia@example.test"})
        assert other.status_code == 302
    assert len(smtp.messages) == 4
