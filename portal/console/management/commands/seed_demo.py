"""Seed the demo: admin, alice and bob in two projects, five tiers (one of them CPU only),
two simulated hosts whose GPUs not in MIG mode follow demand.

Idempotent: running it again updates the same rows.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from portal.accounts.models import Membership, Project
from portal.catalog.models import PriorityClass, SandboxImage, SharingMode, Storage, Tier
from portal.demo import DEMO_HOSTS, DEMO_USERS
from portal.fleet.inventory import do_sync_inventory
from portal.fleet.models import Gpu, GpuMode
from portal.quotas.models import QuotaPolicy
from wire.config import storage_root
from workers.drivers.docker import image_present
from workers.gpu.simulated import SimulatedBackend, parse_sim_spec

SHELL_UNTIL_STOPPED = ["sh", "-c", "while true; do sleep 3600; done"]
# Images scripts/build-python-image.sh builds, listed once they are built on this machine.
BUILT_HERE = {
    "JupyterLab": ("gpushare/notebook:1", ["/usr/local/bin/gpushare-app"], "JupyterLab"),
    "CUDA Python": ("gpushare/cuda-python:1", SHELL_UNTIL_STOPPED, ""),
}

TIERS = [
    # slug, name, mode, isolation, price EUR/GPU-h, priority, max GPUs, description
    (
        "dedicated",
        "Dedicated",
        SharingMode.DEDICATED,
        ["container", "process"],
        2.50,
        "interactive",
        4,
        "Whole GPUs, up to 4 on one host.",
    ),
    (
        "mig",
        "MIG slice",
        SharingMode.MIG,
        ["container", "process"],
        0.60,
        "interactive",
        1,
        "A hardware-isolated MIG slice of an H100.",
    ),
    (
        "mps",
        "MPS share",
        SharingMode.MPS,
        ["container", "process"],
        0.40,
        "standard",
        1,
        "A share of a GPU's memory and SMs through MPS.",
    ),
    (
        "timeslice",
        "Time-slice",
        SharingMode.TIMESLICE,
        ["container", "process"],
        0.20,
        "batch",
        1,
        "Cheap, best-effort batch work: a replica of a GPU time-sliced four ways, sharing the "
        "whole GPU with up to three others; nothing is reserved for it.",
    ),
    (
        "cpu",
        "CPU only",
        SharingMode.CPU,
        ["container", "process"],
        0.05,
        "standard",
        1,
        "Two cores and 2 GiB of a GPU host, no GPU: data preparation and CPU jobs. Per sandbox-hour.",
    ),
]
# Host CPU and memory per sandbox where a tier differs from the default (1 core, 1 GiB).
HOST_SHARE = {"cpu": (2.0, 2048)}


class Command(BaseCommand):
    help = "Seed demo users, projects, tiers and simulated hosts (idempotent)."

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        users = self._users()
        vision, _ = Project.objects.get_or_create(slug="vision-lab", defaults={"name": "Vision Lab"})
        nlp, _ = Project.objects.get_or_create(slug="nlp-lab", defaults={"name": "NLP Lab"})
        Membership.objects.get_or_create(
            user=users["alice"], project=vision, defaults={"role": Membership.Role.MANAGER}
        )
        Membership.objects.get_or_create(
            user=users["bob"], project=nlp, defaults={"role": Membership.Role.MANAGER}
        )
        for project in (vision, nlp):
            QuotaPolicy.objects.get_or_create(project=project)
        classes = {
            name: PriorityClass.objects.update_or_create(
                name=name, defaults={"value": value, "preemptible": preemptible}
            )[0]
            for name, value, preemptible in (
                ("interactive", 200, False),
                ("standard", 100, False),
                ("batch", 50, True),
            )
        }
        for slug, name, mode, isolation, price, priority, max_gpus, description in TIERS:
            Tier.objects.update_or_create(
                slug=slug,
                defaults={
                    "name": name,
                    "sharing_mode": mode,
                    "isolation_levels": isolation,
                    "price_per_gpu_hour_micros": int(price * 1_000_000),
                    "currency": "EUR",
                    "priority_class": classes[priority],
                    "max_gpus": max_gpus,
                    "max_duration": timedelta(hours=8),
                    "description": description,
                    "cpu_limit": HOST_SHARE.get(slug, (1.0, 1024))[0],
                    "memory_limit_mib": HOST_SHARE.get(slug, (1.0, 1024))[1],
                    "pids_limit": 256,
                    # Batch work is preemptible: safe for its first 10 minutes, warned a
                    # minute before its stop, then queued again.
                    **(
                        {
                            "preempt_after": timedelta(minutes=10),
                            "preempt_grace": timedelta(minutes=1),
                            "requeue_on_preemption": True,
                        }
                        if classes[priority].preemptible
                        else {}
                    ),
                },
            )
        self._storage()
        SandboxImage.objects.update_or_create(
            name="busybox",
            defaults={"reference": "gpushare/sandbox-base:1", "command": SHELL_UNTIL_STOPPED},
        )
        for name, (reference, command, app) in BUILT_HERE.items():
            if image_present(reference):  # the demo's agents run on this machine's engine
                SandboxImage.objects.update_or_create(
                    name=name, defaults={"reference": reference, "command": command, "app": app}
                )
        for host, spec in DEMO_HOSTS.items():
            gpus = SimulatedBackend(host, parse_sim_spec(spec)).list_gpus()
            do_sync_inventory(host, "simulated", "", [g.to_json() for g in gpus])
        # Seeded before GPUs followed demand, a demo database pinned two A100s: unpinned again.
        Gpu.objects.filter(host__name__in=DEMO_HOSTS, mig_enabled=False).update(sharing_mode=GpuMode.AUTO)
        self.stdout.write(
            self.style.SUCCESS("demo seeded: " + ", ".join(f"{u}/{p}" for u, p in DEMO_USERS.items()))
        )

    def _storage(self) -> None:
        """A home and a project folder on every tier, and a small read-only dataset, under
        this machine's STORAGE_ROOT (the demo's agents run here)."""
        sample = storage_root() / "datasets" / "sample"
        sample.mkdir(parents=True, exist_ok=True)
        for folder in (storage_root(), sample.parent, sample):
            folder.chmod(0o755)  # every sandbox's uid reads a dataset
        (sample / "README").write_text(
            "A read-only dataset: every sandbox of the demo's tiers sees it here.\n"
        )
        home = {"kind": "home", "directory": "homes", "mount_path": "/home/sandbox", "limit_gib": 10}
        shared = {"kind": "project", "directory": "projects", "mount_path": "/project", "limit_gib": 50}
        data = {"kind": "dataset", "directory": "datasets/sample", "mount_path": "/data/sample"}
        storages = [
            Storage.objects.update_or_create(name=name, defaults=values)[0]
            for name, values in (("Home", home), ("Project folder", shared), ("Sample dataset", data))
        ]
        for tier in Tier.objects.filter(slug__in=[t[0] for t in TIERS]):
            tier.storages.set(storages)

    def _users(self) -> dict[str, Any]:
        User = get_user_model()
        users = {}
        for username, password in DEMO_USERS.items():
            user, created = User.objects.get_or_create(
                username=username,
                defaults={
                    "email": f"{username}@example.org",
                    "is_staff": username == "admin",
                    "is_superuser": username == "admin",
                },
            )
            if created:
                user.set_password(password)
                user.save()
            users[username] = user
        return users
