"""Storage usage the agents measure when a sandbox stops, and the owner's warnings.

A volume at ``WARN_PCT`` of its limit warns the owner whose sandbox filled it; one at its
limit warns again, and new sandboxes that would mount it are refused until files are
deleted (``portal.catalog.storage.storage_refusal``). Each warning is given once per
crossing: a volume that falls back below arms it again.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from portal.catalog.models import StorageVolume
from portal.catalog.storage import WARN_PCT
from portal.sandboxes.models import Notification, Sandbox
from portal.sandboxes.notify import notify_owner
from wire.sizes import human_size

log = logging.getLogger(__name__)


def do_record_storage_usage(sandbox_id: int, usage: dict[int, tuple[int, bool]]) -> None:
    """By the sandbox's id, not its allocation: a requeued one may be placed anew before this
    arrives."""
    sandbox = Sandbox.objects.filter(pk=sandbox_id).first()
    if sandbox is None:
        return
    with transaction.atomic():
        volumes = (
            StorageVolume.objects.select_for_update().select_related("storage").filter(pk__in=list(usage))
        )
        for volume in volumes:
            if volume.user_id not in (None, sandbox.owner_id) or volume.project_id not in (
                None,
                sandbox.project_id,
            ):
                log.warning("sandbox %s reported volume %s, which is not its own", sandbox.pk, volume.pk)
                continue
            used, complete = usage[volume.pk]
            volume.used_bytes = used
            volume.measured_at = timezone.now()
            _warn(sandbox, volume, complete)
            volume.save(update_fields=["used_bytes", "measured_at", "warned_pct"])


def _warn(sandbox: Sandbox, volume: StorageVolume, complete: bool) -> None:
    pct = volume.used_pct
    if pct is None:
        return
    level = 100 if pct >= 100 else WARN_PCT if pct >= WARN_PCT else 0
    if level <= volume.warned_pct:
        volume.warned_pct = level  # below again: the next crossing warns again
        return
    volume.warned_pct = level
    storage = volume.storage
    whose = "Your home" if volume.user_id else "The project's folder"
    at_least = "" if complete else "at least "
    held = f"{whose} on {storage.name} ({storage.mount_path}) holds {at_least}{human_size(volume.used_bytes)}"
    if level == 100:
        message = (
            f"{held}, over its {storage.limit_gib} GiB limit: new sandboxes that mount it are refused "
            "until files are deleted (a CPU-only sandbox can still start)."
        )
    else:
        message = f"{held} of its {storage.limit_gib} GiB limit: past it, new sandboxes are refused."
    notify_owner(sandbox, Notification.Kind.STORAGE, message)
