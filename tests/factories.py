"""factory-boy factories for the portal's models."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth import get_user_model

from portal.accounts.models import Membership, Project
from portal.catalog.models import PriorityClass, SandboxImage, SharingMode, Tier
from wire.liveness import Beat
from wire.messages import InventoryReport


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.org")
    password = factory.django.Password("correct-horse-battery")


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project
        django_get_or_create = ("slug",)

    name = factory.Sequence(lambda n: f"Project {n}")
    slug = factory.Sequence(lambda n: f"project-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    project = factory.SubFactory(ProjectFactory)
    role = Membership.Role.MEMBER


class PriorityClassFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = PriorityClass
        django_get_or_create = ("name",)

    name = "standard"
    value = 100


class TierFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tier
        django_get_or_create = ("slug",)

    name = factory.LazyAttribute(lambda t: t.slug.title())
    slug = SharingMode.DEDICATED
    sharing_mode = factory.LazyAttribute(lambda t: t.slug)
    isolation_levels = ["container", "process"]
    price_per_gpu_hour_micros = 2_500_000
    currency = "EUR"
    priority_class = factory.SubFactory(PriorityClassFactory)
    max_gpus = 4
    max_duration = timedelta(hours=8)
    cpu_limit = 0.5
    memory_limit_mib = 256
    pids_limit = 64


class ImageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = SandboxImage
        django_get_or_create = ("name",)

    name = "busybox"
    reference = "gpushare/sandbox-base:1"
    command = ["sh", "-c", "while true; do sleep 3600; done"]


def inventory(
    host: str, gpus: list[dict[str, Any]], *, driver: str = "docker", started: bool = False
) -> InventoryReport:
    """``host``'s inventory (``gpus``: ``GpuInfo.to_json()`` each), as ``agent_inventories``
    takes it: 64 cores and 512 GiB."""
    return InventoryReport(
        host=host, backend="simulated", driver=driver, gpus=gpus,
        facts={"cpu_cores": 64, "memory_mib": 512 * 1024}, started=started,
    )  # fmt: skip


def beat(
    host: str, *, driver: str = "docker", alerts_version: str | None = None, t_ms: int | None = None
) -> Beat:
    """A heartbeat from ``host`` now (or at ``t_ms``), with no report, as ``agent_heartbeats``
    takes it."""
    return Beat(
        host=host,
        t_ms=int(time.time() * 1000) if t_ms is None else t_ms,
        backend="simulated",
        driver=driver,
        owned=None,
        owned_ms=None,
        alerts_version=alerts_version,
    )
