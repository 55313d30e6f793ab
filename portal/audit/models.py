"""The audit log: who changed what, with the values before and after. Append-only.

Rows are written by ``portal.audit.trail`` (admin and console changes to the catalog,
quotas, projects, memberships and GPUs, and every sandbox state change one person made on
another's behalf). The model refuses updates and deletes, and the migration adds database
triggers that refuse them too, so not even a raw query rewrites history.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class AuditQuerySet(models.QuerySet["AuditEntry"]):
    """Bulk writes skip save() and delete(): refuse them here too, on every database
    (SQLite's trigger refuses UPDATE only)."""

    def update(self, **kwargs: Any) -> int:
        raise PermissionError("the audit log is append-only: entries cannot be changed")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise PermissionError("the audit log is append-only: entries cannot be deleted")


class AuditEntry(models.Model):
    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)  # kept even if the user is renamed
    action = models.CharField(max_length=40)  # created, changed, deleted, drained, sandbox.stopping, ...
    target_type = models.CharField(max_length=60)  # e.g. catalog.tier
    target_id = models.CharField(max_length=64)
    target_repr = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    message = models.CharField(max_length=300, blank=True)

    objects = AuditQuerySet.as_manager()

    class Meta:
        # The table and its append-only triggers were created by the console app, which
        # owned this model first (console 0001); the audit app took it over in place.
        db_table = "console_auditentry"
        ordering = ["-at", "-pk"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["target_type", "target_id"], name="audit_target_idx")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action} {self.target_repr}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise PermissionError("the audit log is append-only: an entry cannot be changed")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise PermissionError("the audit log is append-only: an entry cannot be deleted")

    @property
    def changes(self) -> list[tuple[str, Any, Any]]:
        """(field, before, after) for every field whose value differs."""
        before, after = self.before or {}, self.after or {}
        return [
            (k, before.get(k), after.get(k))
            for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k)
        ]
