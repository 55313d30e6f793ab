"""Webhook endpoints and their deliveries (moved from billing; the tables keep their names).

The event names are listed here, the vocabulary endpoints subscribe to; each event's
payload is built by the app that owns its data (billing, sandboxes, telemetry).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from datetime import datetime

from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from portal.accounts.models import Project
from portal.webhooks import destinations

SECRET_PREFIX = "whsec_"  # noqa: S105 - Standard Webhooks: whsec_<base64 of the key>
SECRET_BYTES = 32


class WebhookEvent(models.TextChoices):
    INVOICE_FINALIZED = "invoice.finalized", "invoice.finalized"
    SANDBOX_STOPPED = "sandbox.stopped", "sandbox.stopped"
    USAGE_CLOSED = "usage.closed", "usage.closed"
    ALERT_RAISED = "alert.raised", "alert.raised"
    ALERT_CLEARED = "alert.cleared", "alert.cleared"


def new_secret() -> str:
    """A fresh signing secret, as Standard Webhooks writes one."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The key bytes of a ``whsec_`` secret; ValueError when it is not one."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("a webhook secret is whsec_ followed by base64") from exc
    if not key:
        raise ValueError("a webhook secret may not be empty")
    return key


class WebhookEndpoint(models.Model):
    """Where events are POSTed, signed the Standard Webhooks way with ``secret``.

    Rotating the secret keeps the one it replaces in ``previous_secret`` until
    ``previous_secret_expires_at``; until then every delivery carries a signature under
    each, so a receiver verifies with either while it switches over.
    """

    url = models.URLField(max_length=500)
    secret = models.CharField(
        max_length=200,
        default=new_secret,
        help_text="whsec_ followed by the base64 key (Standard Webhooks). Give it to the receiver.",
    )
    previous_secret = models.CharField(max_length=200, blank=True, editable=False)
    previous_secret_expires_at = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="Until then deliveries are signed with both secrets."
    )
    events = models.JSONField(
        default=list,
        help_text="Among alert.cleared, alert.raised, invoice.finalized, sandbox.stopped, usage.closed.",
    )
    # Null: every project's events (and alerts on no sandbox); otherwise that project's only.
    project = models.ForeignKey(
        Project, on_delete=models.CASCADE, null=True, blank=True, related_name="webhook_endpoints"
    )
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "billing_webhookendpoint"
        ordering = ["pk"]

    def __str__(self) -> str:
        return self.url

    def clean(self) -> None:
        errors = {}
        known = set(WebhookEvent.values)
        if not isinstance(self.events, list) or not self.events or not set(self.events) <= known:
            errors["events"] = f"a non-empty list among {', '.join(sorted(known))}; got {self.events!r}"
        try:
            secret_key(self.secret)
        except ValueError as exc:
            errors["secret"] = str(exc)
        # Said here, on the form's URL field; every delivery checks the address again.
        if self.url and (problem := destinations.url_problem(self.url)):
            errors["url"] = problem
        if errors:
            raise ValidationError(errors)

    def signing_secrets(self, now: datetime) -> list[str]:
        """The secrets a delivery is signed with now: the current one, and the previous one
        while its grace lasts."""
        valid = [self.secret]
        expires = self.previous_secret_expires_at
        if self.previous_secret and expires is not None and now < expires:
            valid.append(self.previous_secret)
        return valid


class WebhookDelivery(models.Model):
    """One event for one endpoint, with the outcome of its attempts (``attempt_log`` keeps
    each: time, HTTP status or error, milliseconds). Receivers dedupe on ``event_id``."""

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=40, choices=WebhookEvent.choices)
    event_id = models.UUIDField()
    payload = models.JSONField()
    attempts = models.PositiveIntegerField(default=0)
    last_status = models.IntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    attempt_log = models.JSONField(default=list, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "billing_webhookdelivery"
        ordering = ["-created_at", "-pk"]
        verbose_name_plural = "webhook deliveries"
        constraints = [
            models.UniqueConstraint(
                fields=["endpoint", "event_id"],
                name="billing_webhookdelivery_once_per_endpoint",
                violation_error_message="An event is delivered once to each endpoint.",
            ),
        ]
        indexes = [
            # The sweeper re-enqueues due retries: WHERE delivered_at IS NULL AND next_attempt_at <= now.
            models.Index(
                fields=["next_attempt_at"],
                name="webhook_delivery_due_idx",
                condition=models.Q(delivered_at__isnull=True, next_attempt_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.event_id} -> {self.endpoint_id}"

    @property
    def status(self) -> str:
        if self.delivered_at is not None:
            return "delivered"
        return "pending" if self.next_attempt_at is not None else "failed"
