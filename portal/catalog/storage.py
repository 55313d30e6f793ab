"""Which storage a sandbox gets, and whether its owner may start one: the volumes of a
tier's storage for a user and a project, their mounts, and their measured usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import models

from portal.catalog.models import Storage, StorageVolume, Tier
from wire.sizes import human_size
from wire.storage import StorageMount

WARN_PCT = 90  # an owner hears of a volume this full, and again when it is over its limit


@dataclass(frozen=True)
class StorageLine:
    """One storage as the request form and the project page show it."""

    storage: Storage
    volume: StorageVolume | None  # None: a dataset, or a volume no sandbox has mounted yet

    @property
    def whose(self) -> str:
        whose = {Storage.Kind.HOME: "your home", Storage.Kind.PROJECT: "the project's folder"}
        return whose.get(Storage.Kind(self.storage.kind), "read-only dataset")

    @property
    def used_bytes(self) -> int:
        return self.volume.used_bytes if self.volume else 0

    @property
    def used_pct(self) -> float | None:
        limit = self.storage.limit_bytes
        return 100.0 * self.used_bytes / limit if limit else None

    @property
    def over_limit(self) -> bool:
        return bool(self.storage.limit_gib) and self.used_bytes >= self.storage.limit_bytes

    @property
    def usage(self) -> str:
        """ "2.1 GiB of 10 GiB used", "5.0 MiB used (no limit)", "" for a dataset."""
        if self.storage.read_only:
            return ""
        used = human_size(self.used_bytes)
        if not self.storage.limit_gib:
            return f"{used} used (no limit)"
        return f"{used} of {self.storage.limit_gib} GiB used"


def _volume_filter(storage: Storage, user: Any, project: Any) -> dict[str, Any]:
    return {"user": user} if storage.kind == Storage.Kind.HOME else {"project": project}


def storage_lines(tier: Tier | None, user: Any, project: Any) -> list[StorageLine]:
    """The tier's open storage for this user in this project, with what is known of its usage
    (no tier: the storage of every open tier, as the project page shows it). Two queries."""
    storages = tier.storages.all() if tier is not None else Storage.objects.filter(tiers__active=True)
    listed = list(storages.filter(active=True).distinct().order_by("kind", "name"))
    volumes: dict[int, StorageVolume] = {}
    if any(not s.read_only for s in listed):
        mine = StorageVolume.objects.filter(storage__in=listed).filter(
            models.Q(storage__kind=Storage.Kind.HOME, user=user)
            | models.Q(storage__kind=Storage.Kind.PROJECT, project=project)
        )
        volumes = {v.storage_id: v for v in mine}
    return [StorageLine(s, volumes.get(s.pk)) for s in listed]


def storage_refusal(tier: Tier, user: Any, project: Any) -> str | None:
    """Why a new sandbox of this tier may not start: a volume it would mount is over its
    limit. CPU-only tiers are let through, so that the owner can clean up without a GPU."""
    if tier.cpu_only:
        return None
    for line in storage_lines(tier, user, project):
        if line.over_limit:
            held = human_size(line.used_bytes)
            return (
                f"{line.whose.capitalize()} on {line.storage.name} holds {held} of its "
                f"{line.storage.limit_gib} GiB limit: delete files (a CPU-only sandbox can still start) "
                "or ask an admin to raise the limit."
            )
    return None


def mounts_for(tier: Tier, user: Any, project: Any) -> tuple[StorageMount, ...]:
    """The launch message's mounts, making the user's or project's volume on first use."""
    mounts = []
    for storage in tier.storages.filter(active=True).order_by("kind", "name"):
        if storage.read_only:
            mounts.append(StorageMount(storage.name, storage.directory, storage.mount_path, True, 0))
            continue
        volume, _ = StorageVolume.objects.get_or_create(
            storage=storage, **_volume_filter(storage, user, project)
        )
        mounts.append(volume.mount())
    return tuple(mounts)
