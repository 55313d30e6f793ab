"""A compromised host speaking for another (issue 38): with host A's own Redis user and key,
a heartbeat and a report claiming to be host B reach the real control worker, which drops
them and raises an alert; B's own key is believed."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signature
from django.conf import settings
from django.utils import timezone

from portal.fleet.models import Host
from portal.sandboxes.models import Sandbox
from portal.telemetry.models import Alert
from tests.conftest import seed_host
from tests.e2e.platform import running_platform, wait_for
from tests.factories import beat
from tests.portal.helpers import request
from wire import config, signing

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def send_as(credential: dict[str, str], signer_name: str, task: str, *args: Any) -> None:
    """``task`` (``workers.control.<task>``, or a full name) onto the control queue through the
    broker as a host's agent reaches it (its own Redis user where it has one), signed with that
    host's key."""
    app = Celery("forger", broker=config.celery_broker_url(credential.get("REDIS_URL", settings.REDIS_URL)))
    signer = signing.Signer(signer_name, signing.private_key(credential["GPUSHARE_HOST_KEY"]))
    name = task if "." in task else f"workers.control.{task}"
    try:
        with signing.signing_as(signer):
            app.send_task(name, args=list(args), queue="control")
    finally:
        app.close()


def test_a_heartbeat_for_host_b_sent_with_host_as_credentials_changes_nothing_and_alerts(
    tmp_path: Path, people: Any, catalog: Any
) -> None:
    with running_platform(tmp_path, sim_gpus="A100-80GB:1", driver="simulated") as platform:
        a, b = platform.host, f"{platform.host}-b"
        seed_host(b, "A100-80GB:1")
        platform.agent_credential(b)  # B is enrolled; its agent is not running
        long_ago = timezone.now() - timedelta(minutes=10)
        Host.objects.filter(name=b).update(state=Host.State.LOST, last_heartbeat_at=long_ago)
        # A sandbox that runs on B (as the database has it).
        on_b = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
        key_b = uuid.uuid4().hex
        Sandbox.objects.filter(pk=on_b.pk).update(
            host=Host.objects.get(name=b), allocation_key=key_b, state="running", started_at=long_ago
        )

        # Step 1: A's user and key, B's name: dropped, B stays lost, an alert names A.
        send_as(platform.credentials[a], signing.host_signer(a), "agent_heartbeats", [beat(b)])
        # Also signed as B by A's key: the signature does not verify.
        send_as(platform.credentials[a], signing.host_signer(b), "agent_heartbeats", [beat(b)])
        wait_for(
            lambda: Alert.objects.filter(kind=Alert.Kind.FORGED, host__name=a).exists(),
            30,
            lambda: "the forged heartbeat's alert\n" + platform.logs(),
        )
        wait_for(
            lambda: "its signature does not verify" in platform.logs(),
            30,
            lambda: "the misattributed one to be logged\n" + platform.logs(),
        )
        # A report on B's sandbox, sent as A: dropped too, the sandbox runs on.
        send_as(platform.credentials[a], signing.host_signer(a), "sandbox_stopped", key_b, 0, "stopped")
        wait_for(
            lambda: Alert.objects.filter(
                kind=Alert.Kind.FORGED, host__name=a, message__contains="sandbox_stopped"
            ).exists(),
            30,
            lambda: "the forged report's alert\n" + platform.logs(),
        )
        assert Sandbox.objects.get(pk=on_b.pk).state == "running"
        # Through Celery's own canvas task, which would run the heartbeat task in process.
        heartbeats = signature("workers.control.agent_heartbeats")
        send_as(platform.credentials[a], signing.host_signer(a), "celery.map", heartbeats, [[beat(b)]])
        wait_for(
            lambda: Alert.objects.filter(
                kind=Alert.Kind.FORGED, host__name=a, message__contains="celery.map"
            ).exists(),
            30,
            lambda: "the canvas task's alert\n" + platform.logs(),
        )
        alert = Alert.objects.get(kind=Alert.Kind.FORGED, host__name=a, message__contains="agent_heartbeats")
        assert f"agent_heartbeats from host:{a} dropped: speaks for {b}" in alert.message
        host_b = Host.objects.get(name=b)
        assert host_b.state == Host.State.LOST and host_b.last_heartbeat_at == long_ago
        # The agent of A itself goes on being believed.
        began = timezone.now()
        wait_for(
            lambda: (Host.objects.get(name=a).last_heartbeat_at or began) > began, 15, "A's own heartbeats"
        )

        # Step 2: the same heartbeat with B's own key is believed: B is back.
        send_as(platform.credentials[b], signing.host_signer(b), "agent_heartbeats", [beat(b)])
        wait_for(
            lambda: Host.objects.get(name=b).state == Host.State.UP,
            30,
            lambda: "B's own heartbeat to be believed\n" + platform.logs(),
        )
