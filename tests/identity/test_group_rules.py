"""Group rules: what an admin sets in the console (audited, refused when malformed, staff
only) and how groups become roles (the highest wins), without any identity server."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model

from portal.accounts.models import Membership, Project
from portal.audit.models import AuditEntry
from portal.identity.models import GroupRule
from portal.identity.sign_in import Profile, free_username, roles_for, sign_in
from tests.portal.helpers import client_for

pytestmark = pytest.mark.django_db


def test_the_highest_role_wins_when_several_groups_reach_a_project(people: Any) -> None:
    vision = people["project"]
    GroupRule.objects.create(source="oidc", group="readers", project=vision, role="billing")
    GroupRule.objects.create(source="oidc", group="leads", project=vision, role="manager")
    GroupRule.objects.create(source="oidc", group="staff", project=vision, role="member")
    GroupRule.objects.create(source="oidc", group="old", project=people["other_project"], active=False)
    assert roles_for("oidc", ["readers", "staff"]) == {vision.pk: "member"}
    assert roles_for("oidc", ["readers", "leads", "staff", "old"]) == {vision.pk: "manager"}
    assert roles_for("ldap", ["leads"]) == {}


def test_a_sign_in_with_no_matching_group_joins_nothing_and_keeps_hand_made_memberships(people: Any) -> None:
    user = sign_in(Profile(source="oidc", subject="abc-123", username="nadia", groups=["elsewhere"]))
    assert user is not None and not Membership.objects.filter(user=user).exists()
    Membership.objects.create(user=user, project=people["project"], role="member")
    GroupRule.objects.create(source="oidc", group="elsewhere", project=people["project"], role="manager")
    sign_in(Profile(source="oidc", subject="abc-123", username="nadia", groups=["elsewhere"]))
    # The manager's membership stands as made: the rules change only what they made.
    assert Membership.objects.get(user=user).role == "member"
    assert sign_in(Profile(source="oidc", subject="abc-123", username="renamed")) == user


def test_free_usernames_keep_clear_of_taken_ones(people: Any) -> None:
    assert free_username("olivia", "oidc") == "olivia-oidc"
    get_user_model().objects.create(username="olivia-oidc")
    assert free_username("olivia", "oidc") == "olivia-oidc-2"
    assert free_username("jo hn/<x>", "ldap") == "johnx"
    assert free_username("", "ldap") == "ldap"


def test_an_admin_adds_a_rule_in_the_console_and_the_audit_log_keeps_it(people: Any) -> None:
    admin = client_for(people["admin"])
    form = admin.get("/console/catalog/group-rules/new/")
    assert form.status_code == 200 and "groups claim" in form.content.decode()
    saved = admin.post(
        "/console/catalog/group-rules/new/",
        {
            "source": "ldap",
            "group": " ml-lab ",
            "project": people["project"].pk,
            "role": "member",
            "active": "on",
        },
    )
    assert saved.status_code == 302
    rule = GroupRule.objects.get()
    assert rule.group == "ml-lab"
    assert AuditEntry.objects.filter(target_type="identity.grouprule", action="created").exists()
    assert "ml-lab" in admin.get("/console/catalog/").content.decode()


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"group": "   "}, "group", "This field is required"),
        ({"source": "saml"}, "source", "not one of the available choices"),
        ({"role": "owner"}, "role", "not one of the available choices"),
        ({"project": "999999"}, "project", "not one of the available choices"),
    ],
)
def test_a_malformed_rule_is_a_form_error(
    people: Any, fields: dict[str, str], field: str, message: str
) -> None:
    data = {"source": "oidc", "group": "lab", "project": people["project"].pk, "role": "member", **fields}
    answer = client_for(people["admin"]).post("/console/catalog/group-rules/new/", data)
    assert answer.status_code == 400
    assert message in str(answer.context["form"].errors[field])
    assert not GroupRule.objects.exists()


def test_a_second_rule_for_the_same_group_and_project_is_refused(people: Any) -> None:
    GroupRule.objects.create(source="oidc", group="lab", project=people["project"])
    data = {"source": "oidc", "group": "lab", "project": people["project"].pk, "role": "manager"}
    answer = client_for(people["admin"]).post("/console/catalog/group-rules/new/", data)
    assert answer.status_code == 400 and "already maps this group" in answer.content.decode()


def test_only_staff_see_or_change_the_rules(people: Any) -> None:
    owner = client_for(people["owner"])
    assert owner.get("/console/catalog/group-rules/new/").status_code == 302  # to the admin sign-in
    rule = {"source": "oidc", "group": "x", "project": people["project"].pk, "role": "manager"}
    owner.post("/console/catalog/group-rules/new/", rule)
    assert not GroupRule.objects.exists()
    assert Project.objects.count() == 2
