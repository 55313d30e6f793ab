"""Sign-in with a directory password against a real OpenLDAP server (slapd on loopback): the
user made at the first sign-in, projects from the directory's groups by the admin's rules,
re-applied at every sign-in; local accounts untouched (issue 22)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client, override_settings

from portal.accounts.models import Membership, Project
from portal.audit.models import AuditEntry
from portal.identity.models import ExternalIdentity, GroupRule, MappedMembership
from tests.conftest import PASSWORD
from tests.factories import UserFactory
from tests.identity.conftest import PEOPLE

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _no_lockouts() -> None:
    cache.clear()  # failed sign-ins of another test count toward the throttle


@pytest.fixture
def rules(people: Any) -> dict[str, Project]:
    ml = Project.objects.create(name="ML Lab", slug="ml-lab")
    GroupRule.objects.create(source="ldap", group="ml-lab", project=ml, role="member")
    GroupRule.objects.create(source="ldap", group="vision-leads", project=people["project"], role="manager")
    GroupRule.objects.create(source="oidc", group="ml-lab", project=people["other_project"], role="member")
    return {"ml": ml, "vision": people["project"]}


def sign_in(username: str, password: str) -> tuple[Client, Any]:
    browser = Client()
    answer = browser.post("/login/", {"username": username, "password": password})
    return browser, answer


def roles(user: Any) -> dict[str, str]:
    return dict(Membership.objects.filter(user=user).values_list("project__slug", "role"))


def test_a_directory_user_signs_in_and_lands_in_their_groups_projects(ldap_portal: Any, rules: Any) -> None:
    browser, answer = sign_in("lena", PEOPLE["lena"])
    assert answer.status_code == 302, answer.content.decode()[:500]
    identity = ExternalIdentity.objects.select_related("user").get(source="ldap")
    lena = identity.user
    assert identity.subject == "uid=lena,ou=people,dc=example,dc=test"
    assert identity.groups == ["ml-lab", "vision-leads"]
    assert lena.username == "lena" and lena.email == "lena@example.test" and not lena.has_usable_password()
    # vision-leads makes her a manager of Vision; the OIDC rule for ml-lab is not LDAP's.
    assert roles(lena) == {"ml-lab": "member", "vision": "manager"}
    assert browser.get("/projects/").status_code == 200
    assert "ML Lab" in browser.get("/projects/").content.decode()
    entry = AuditEntry.objects.get(action="identity.groups_applied")
    assert "added to ML Lab (member), Vision (manager)" in entry.message


def test_a_wrong_directory_password_is_refused(ldap_portal: Any, rules: Any) -> None:
    _, answer = sign_in("lena", "not-her-password")
    assert answer.status_code == 200 and "correct username and password" in answer.content.decode()
    assert not get_user_model().objects.filter(username="lena").exists()


def test_leaving_a_group_leaves_the_project_at_the_next_sign_in(ldap_portal: Any, rules: Any) -> None:
    sign_in("tom", PEOPLE["tom"])
    tom = get_user_model().objects.get(username="tom")
    assert roles(tom) == {"ml-lab": "member"}
    # A manager also adds Tom to NLP by hand: the rules never touch that membership.
    Membership.objects.create(
        user=tom, project=rules["vision"].__class__.objects.get(slug="nlp"), role="member"
    )

    ldap_portal.remove_member("ml-lab", "tom")
    _, answer = sign_in("tom", PEOPLE["tom"])
    assert answer.status_code == 302
    assert roles(tom) == {"nlp": "member"}
    assert ExternalIdentity.objects.get(user=tom).groups == []
    newest = AuditEntry.objects.filter(action="identity.groups_applied").values_list("message", flat=True)
    assert "removed from ML Lab" in newest[0]


def test_rule_changes_apply_at_the_next_sign_in(ldap_portal: Any, rules: Any) -> None:
    sign_in("lena", PEOPLE["lena"])
    lena = get_user_model().objects.get(username="lena")
    GroupRule.objects.filter(group="ml-lab", source="ldap").update(role="manager")
    GroupRule.objects.filter(group="vision-leads").update(active=False)
    sign_in("lena", PEOPLE["lena"])
    assert roles(lena) == {"ml-lab": "manager"}
    assert MappedMembership.objects.filter(membership__user=lena).count() == 1


def test_a_directory_entry_never_takes_over_a_local_account_of_the_same_name(
    ldap_portal: Any, rules: Any, people: Any
) -> None:
    local_admin: Any = UserFactory(username="admin", is_staff=True)
    _, answer = sign_in("admin", PEOPLE["admin"])
    assert answer.status_code == 302
    made = ExternalIdentity.objects.get(source="ldap").user
    assert made.pk != local_admin.pk and made.username == "admin-ldap" and not made.is_staff
    # The local admin still signs in with the local password, the directory's not being theirs.
    _, answer = sign_in("admin", PASSWORD)
    assert answer.status_code == 302
    assert Client().login(username="admin", password=PASSWORD)


def test_a_deactivated_user_cannot_sign_in_with_the_directory(ldap_portal: Any, rules: Any) -> None:
    sign_in("lena", PEOPLE["lena"])
    get_user_model().objects.filter(username="lena").update(is_active=False)
    _, answer = sign_in("lena", PEOPLE["lena"])
    assert answer.status_code == 200


def test_local_sign_in_may_be_left_to_staff(ldap_portal: Any, people: Any) -> None:
    from portal.identity.config import authentication_backends

    with override_settings(AUTHENTICATION_BACKENDS=authentication_backends(False, True, "staff")):
        assert sign_in("olivia", PASSWORD)[1].status_code == 200  # a local non-staff account
        assert sign_in("ada", PASSWORD)[1].status_code == 302  # a local admin
        assert sign_in("tom", PEOPLE["tom"])[1].status_code == 302  # the directory's people


def test_a_directory_that_cannot_be_reached_is_a_logged_failure(
    ldap_portal: Any, rules: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with override_settings(AUTH_LDAP_SERVER_URI="ldap://127.0.0.1:9"), caplog.at_level(logging.ERROR):
        _, answer = sign_in("lena", PEOPLE["lena"])
    assert answer.status_code == 200
    assert any(
        "LDAP" in r.getMessage() and "Can't contact LDAP server" in r.getMessage() for r in caplog.records
    )
