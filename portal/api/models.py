"""The API's own table: stored answers to POSTs sent with an ``Idempotency-Key``."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone


class IdempotencyKey(models.Model):
    """The stored answer to a POST sent with an ``Idempotency-Key`` header (24 h).

    The row is inserted first, in the request's transaction, so a concurrent duplicate
    blocks on the unique index until the first commits and then replays its answer.
    """

    TTL = timedelta(hours=24)

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="idempotency_keys"
    )
    key = models.CharField(max_length=255)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)  # SHA-256 of the canonical request body
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        # Made by the accounts app, moved here with its table and names unchanged.
        db_table = "accounts_idempotencykey"
        constraints = [
            models.UniqueConstraint(
                fields=["user", "key"],
                name="accounts_idempotencykey_one_per_user_key",
                violation_error_message="This idempotency key was already used.",
            )
        ]
        indexes = [
            # delete_expired_keys(): DELETE ... WHERE created_at < now() - 24 h
            models.Index(fields=["created_at"], name="idempotency_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.method} {self.path} key {self.key!r}"
