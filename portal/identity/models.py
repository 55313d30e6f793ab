"""Who a user is at an identity provider, and the rules that turn its groups into projects.

Users who sign in through OpenID Connect or LDAP are found by the provider's stable id (the
``sub`` claim, the entry's DN), never by username or email: those can be reassigned, and
matching on them would hand a local account (an admin's) to whoever the provider next
calls by that name.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.accounts.models import Membership, Project


class Source(models.TextChoices):
    OIDC = "oidc", "OpenID Connect"
    LDAP = "ldap", "LDAP directory"


class GroupRule(models.Model):
    """An admin's rule: whoever the provider ``source`` says is in ``group`` is in ``project``
    with ``role``. Applied at every sign-in through that provider, so a user taken out of the
    group loses the project the next time they sign in."""

    source = models.CharField(max_length=8, choices=Source.choices)
    group = models.CharField(
        max_length=255,
        help_text="OpenID Connect: a value of the groups claim. LDAP: the group's name (its cn).",
    )
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="group_rules")
    role = models.CharField(max_length=16, choices=Membership.Role.choices, default=Membership.Role.MEMBER)
    active = models.BooleanField(default=True, help_text="Inactive rules grant nothing at the next sign-in.")

    class Meta:
        ordering = ["source", "group", "project__name"]
        constraints = [
            models.UniqueConstraint(
                fields=["source", "group", "project"],
                name="%(app_label)s_%(class)s_one_per_group_project",
                violation_error_message="A rule already maps this group to this project.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.get_source_display()} group {self.group} → {self.project} ({self.role})"


class ExternalIdentity(models.Model):
    """A user as an identity provider knows them; made at their first sign-in there."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_identities"
    )
    source = models.CharField(max_length=8, choices=Source.choices)
    # OIDC: the sub claim; LDAP: the entry's DN, lower-cased (DNs compare case-insensitively).
    subject = models.CharField(max_length=255)
    groups = models.JSONField(default=list)  # as the provider said at the last sign-in
    signed_in_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["source", "subject"], name="%(app_label)s_%(class)s_one_per_subject"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} at {self.get_source_display()} ({self.subject})"


class MappedMembership(models.Model):
    """Marks a membership the group rules made, so the next sign-in through ``source`` may
    change its role or remove it. Memberships a project manager added are never touched."""

    membership = models.OneToOneField(Membership, on_delete=models.CASCADE, related_name="mapping")
    source = models.CharField(max_length=8, choices=Source.choices)

    def __str__(self) -> str:
        return f"{self.membership} (from {self.source} groups)"
