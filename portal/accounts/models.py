"""Users belong to projects through memberships; API tokens are stored hashed; SSH keys."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.conf import settings
from django.db import models
from django.utils import timezone


class Project(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        MANAGER = "manager", "Project manager"
        MEMBER = "member", "Member"
        BILLING = "billing", "Billing viewer"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    # Set by the project's managers: a student may hold at most 2 GPUs of the group's 8.
    max_gpus = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="GPUs (whole-GPU equivalents) this member's sandboxes in the project may hold or "
        "wait for at once; empty: only the project's limits.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "project"],
                name="%(app_label)s_%(class)s_one_per_user_project",
                violation_error_message="This user is already in this project.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.project} ({self.role})"


def token_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token. Only its SHA-256 is stored; the key is shown once, at creation.

    Made only by ``portal.accounts.tokens.do_issue_token`` (the token page): never by hand,
    where a row without a key could be saved. A token ends at ``expires_at`` or when revoked.

    Why not djangorestframework-api-key: its keys authenticate nobody (a permission class,
    no ``request.user``), while every route here acts for a user and within their projects;
    its user link, scopes and authentication would be ours anyway, and its own hash format
    would have broken every token already handed out to billing systems.
    """

    PREFIX = "gps_"

    class Scope(models.TextChoices):
        READ_USAGE = "read:usage", "Read usage and invoices"
        WRITE_SANDBOXES = "write:sandboxes", "Create and stop sandboxes"
        ADMIN = "admin", "Administer"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)  # serves the lookup on every API call
    key_prefix = models.CharField(max_length=12)  # lets a user tell tokens apart
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(default=timezone.now)
    # None only for tokens made before tokens expired; new ones always carry an end.
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(key_hash=""),
                name="%(app_label)s_%(class)s_has_a_key",
                violation_error_message="A token needs a key: make tokens on the API tokens page.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…)"

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"

    @classmethod
    def issue(
        cls, user: object, name: str, scopes: list[str], expires_at: datetime | None = None
    ) -> tuple[ApiToken, str]:
        """A new token and its key (the only time the key exists outside its holder)."""
        key = cls.PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user,
            name=name,
            key_hash=token_hash(key),
            key_prefix=key[:12],
            scopes=scopes,
            expires_at=expires_at,
        )
        return token, key

    @classmethod
    def find(cls, key: str) -> ApiToken | None:
        """The token with this key, whatever its state (the caller says why it is refused)."""
        return cls.objects.select_related("user").filter(key_hash=token_hash(key)).first()


class SshKey(models.Model):
    """A public key its user logs in to sandboxes with, over SSH through the portal
    (``gpushare ssh-config``). Every key of the connecting user, and only theirs, is handed
    to the sandbox's sshd for that one connection (portal/tunnels/ssh.py). Added and removed
    by ``portal.accounts.ssh_keys``, which checks the key whole first.

    Which of the offered keys the client logged in with is known only to the sshd inside the
    sandbox, which the tenant controls: so the portal records when a key was last offered,
    not a use it cannot see."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ssh_keys")
    name = models.CharField(max_length=100)
    public_key = models.TextField()  # "<type> <base64>": no options, no comment (wire.ssh.bare_key)
    fingerprint = models.CharField(max_length=64)  # "SHA256:<base64>", as ssh-keygen -l shows it
    created_at = models.DateTimeField(default=timezone.now)
    last_offered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # Its index serves the one query of an SSH connection: a user's keys.
            models.UniqueConstraint(
                fields=["user", "fingerprint"],
                name="%(app_label)s_%(class)s_once_per_user",
                violation_error_message="This key is already on your account.",
            ),
            models.CheckConstraint(
                condition=models.Q(fingerprint__startswith="SHA256:"),
                name="%(app_label)s_%(class)s_has_a_fingerprint",
                violation_error_message="Add SSH keys through the account's SSH keys page or API.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint})"

    @property
    def key_type(self) -> str:
        return self.public_key.split(" ", 1)[0]
