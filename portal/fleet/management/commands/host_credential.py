"""``manage.py host_credential issue|rotate|revoke|list|reconcile``: a GPU host's own Redis user."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.fleet import credentials
from portal.fleet.models import HostCredential


class Command(BaseCommand):
    help = (
        "Enrol a GPU host: issue its own Redis user (it may read only its own queue and push only "
        "to the control queue), rotate its password, revoke it (its agent is cut off and the host "
        "is marked lost), list them, or apply them to Redis again after a restart."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "action",
            choices=["issue", "rotate", "renew", "revoke", "list", "reconcile"],
            help="renew: issue, or rotate the active one (for scripts that enrol on every start)",
        )
        parser.add_argument("host", nargs="?", help="the host's name, as its agent's GPUSHARE_HOST")
        parser.add_argument(
            "--pool",
            action="store_true",
            help="issue/renew for an agent pool (one process serving many simulated hosts): the "
            "name is the prefix every host of its file starts with (GPUSHARE_POOL_PREFIX)",
        )
        parser.add_argument(
            "--out",
            type=Path,
            help="write the agent's broker URL to this file (mode 0600) instead of printing it: "
            "copy it to the host as /etc/gpushare/credentials/redis_url",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        action, host, out = options["action"], options["host"], options["out"]
        if action in ("issue", "rotate", "renew", "revoke") and not host:
            raise CommandError(f"{action} needs a host name")
        try:
            if action == "list":
                for credential in HostCredential.objects.all():
                    name = f"{credential.host}*" if credential.pool else credential.host
                    self.stdout.write(f"{name}\t{'revoked' if credential.revoked_at else 'active'}")
                return
            if action == "reconcile":
                self.stdout.write(f"{credentials.reconcile()} host users applied")
                return
            if action == "revoke":
                credentials.revoke(host)
                self.stdout.write(f"{host}: revoked; its agent is cut off")
                return
            if action == "issue":
                url = credentials.issue(host, pool=options["pool"])
            elif action == "renew":
                url = credentials.renew(host, pool=options["pool"])
            else:
                url = credentials.rotate(host)
        except credentials.CredentialError as exc:
            raise CommandError(str(exc)) from exc
        if out is None:
            self.stdout.write(url)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as sink:
            sink.write(url + "\n")
        self.stdout.write(f"{host}: broker URL written to {out}")
