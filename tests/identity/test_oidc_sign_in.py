"""Sign-in through a real OpenID Connect provider (django-oidc-provider, its own server
process on loopback): the authorization-code flow with PKCE end to end, the user found by
``sub``, projects from the ``groups`` claim by the admin's rules (issue 22). The portal's
side runs in the test client; the provider's sign-in page is driven over HTTP like a
browser would (tests/browser/test_sso_browser.py does it in Chromium)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from django.contrib.auth import get_user_model
from django.test import Client, override_settings

from portal.accounts.models import Membership, Project
from portal.identity.models import ExternalIdentity, GroupRule
from tests.factories import UserFactory
from tests.identity.servers import Provider, running_provider

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
CALLBACK = "http://testserver/oidc/callback/"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    with running_provider(tmp_path_factory.mktemp("idp")) as running:
        running.start(CALLBACK)
        running.user("maria", "maria-idp-pass", "ml-lab", "vision-leads")
        yield running


@pytest.fixture
def oidc_portal(provider: Provider, monkeypatch: pytest.MonkeyPatch, people: Any) -> Iterator[Provider]:
    from portal.identity.config import authentication_backends, oidc_settings

    for name, value in provider.settings_env().items():
        monkeypatch.setenv(name, value)
    made = oidc_settings()
    made.pop("OIDC_ENABLED")
    ml = Project.objects.create(name="ML Lab", slug="ml-lab")
    GroupRule.objects.create(source="oidc", group="ml-lab", project=ml, role="member")
    GroupRule.objects.create(source="oidc", group="vision-leads", project=people["project"], role="manager")
    with override_settings(
        **made, OIDC_ENABLED=True, AUTHENTICATION_BACKENDS=authentication_backends(True, False)
    ):
        yield provider


def sign_in_at_provider(portal: Client, username: str, password: str) -> Any:
    """Start at the portal, sign in on the provider's page, come back with the code: the
    portal's answer to its callback."""
    start = portal.get("/oidc/authenticate/?next=/projects/")
    assert (
        start.status_code == 302 and "code_challenge=" in start["Location"] and "nonce=" in start["Location"]
    )
    idp = requests.Session()
    page = idp.get(start["Location"], timeout=10)  # the provider sends us to its sign-in form
    assert page.status_code == 200 and "Example University" in page.text, page.text[:300]
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    answer = idp.post(
        page.url,
        data={"csrfmiddlewaretoken": csrf, "username": username, "password": password,
              "next": re.search(r'name="next" value="([^"]*)"', page.text).group(1).replace("&amp;", "&")},  # type: ignore[union-attr]
        headers={"Referer": page.url}, allow_redirects=False, timeout=10,
    )  # fmt: skip
    while answer.status_code == 302 and not answer.headers["Location"].startswith(CALLBACK):
        location = answer.headers["Location"]
        if location.startswith("/"):
            location = f"{urlsplit(page.url).scheme}://{urlsplit(page.url).netloc}{location}"
        answer = idp.get(location, allow_redirects=False, timeout=10)
    assert answer.status_code == 302, answer.text[:300]
    back = urlsplit(answer.headers["Location"])
    return portal.get(back.path, dict(part.split("=", 1) for part in back.query.split("&")))


def test_a_provider_user_signs_in_and_lands_in_their_groups_projects(oidc_portal: Provider) -> None:
    portal = Client()
    landed = sign_in_at_provider(portal, "maria", "maria-idp-pass")
    assert landed.status_code == 302 and landed["Location"] == "/projects/"
    identity = ExternalIdentity.objects.select_related("user").get(source="oidc")
    maria = identity.user
    assert (
        maria.username == "maria" and maria.email == "maria@example.test" and not maria.has_usable_password()
    )
    assert identity.groups == ["ml-lab", "vision-leads"]
    assert dict(Membership.objects.filter(user=maria).values_list("project__slug", "role")) == {
        "ml-lab": "member", "vision": "manager"}  # fmt: skip
    assert "ML Lab" in portal.get("/projects/").content.decode()


def test_leaving_a_group_at_the_provider_leaves_the_project(oidc_portal: Provider) -> None:
    sign_in_at_provider(Client(), "maria", "maria-idp-pass")
    oidc_portal.user("maria", "maria-idp-pass", "ml-lab")
    try:
        again = sign_in_at_provider(Client(), "maria", "maria-idp-pass")
        assert again.status_code == 302
        maria = ExternalIdentity.objects.get(source="oidc").user
        assert list(Membership.objects.filter(user=maria).values_list("project__slug", flat=True)) == [
            "ml-lab"
        ]
    finally:
        oidc_portal.user("maria", "maria-idp-pass", "ml-lab", "vision-leads")


def test_a_provider_user_never_takes_over_a_local_account(oidc_portal: Provider) -> None:
    local: Any = UserFactory(username="maria", is_staff=True)
    sign_in_at_provider(Client(), "maria", "maria-idp-pass")
    made = ExternalIdentity.objects.get(source="oidc").user
    assert made.pk != local.pk and made.username == "maria-oidc" and not made.is_staff


def test_a_deactivated_user_is_sent_back_to_the_sign_in_page(oidc_portal: Provider) -> None:
    sign_in_at_provider(Client(), "maria", "maria-idp-pass")
    get_user_model().objects.filter(username="maria").update(is_active=False)
    portal = Client()
    refused = sign_in_at_provider(portal, "maria", "maria-idp-pass")
    assert refused.status_code == 302 and refused["Location"] == "/login/?sso=failed"
    page = portal.get(refused["Location"]).content.decode()
    assert "Single sign-on did not sign you in" in page and "Sign in with Example University" in page


def test_a_callback_without_the_sessions_state_is_refused(oidc_portal: Provider) -> None:
    answer = Client().get("/oidc/callback/", {"code": "stolen", "state": "made-up"})
    assert answer.status_code == 302 and answer["Location"] == "/login/?sso=failed"


def test_without_a_provider_the_sso_pages_are_not_there(people: Any) -> None:
    assert Client().get("/oidc/authenticate/").status_code == 404
    assert Client().get("/oidc/callback/").status_code == 404
    assert "Sign in with" not in Client().get("/login/").content.decode()
