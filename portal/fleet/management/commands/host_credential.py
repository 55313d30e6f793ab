"""``manage.py host_credential issue|rotate|renew|revoke|list|reconcile``: a GPU host's own Redis
user and message-signing key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.fleet import credentials
from portal.fleet.models import HostCredential


class Command(BaseCommand):
    help = (
        "Enrol a GPU host: issue its own Redis user (it may read only its own queue and push only "
        "to the control queue) and the key it signs its reports with, rotate both, revoke them "
        "(its agent is cut off and the host is marked lost), list them, or apply them to Redis "
        "again after a restart."
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
            help="write the agent's credentials to this directory (redis_url, host_key and "
            "control_key.pub, mode 0600) instead of printing them: copy them to the host's "
            "/etc/gpushare/credentials/, which its systemd unit loads",
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
                enrolment = credentials.issue(host, pool=options["pool"])
            elif action == "renew":
                enrolment = credentials.renew(host, pool=options["pool"])
            else:
                enrolment = credentials.rotate(host)
        except credentials.CredentialError as exc:
            raise CommandError(str(exc)) from exc
        if out is None:
            # As environment lines: what an agent started by hand (or a secret store) takes.
            for name, value in enrolment.env().items():
                self.stdout.write(f"{name}={value}")
            return
        written = enrolment.write(out)
        self.stdout.write(f"{host}: {', '.join(p.name for p in written)} written to {out}")
