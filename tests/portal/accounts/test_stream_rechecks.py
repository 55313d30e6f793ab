"""The batch re-check of open WebSockets (portal/accounts/streams.py): one pass asks for every
open socket of the process with a fixed number of queries, and closes exactly those that lost
access. (That a socket closes within a period of losing it, end to end over the ASGI app:
tests/portal/test_probe_findings.py, tests/portal/tunnels/test_terminal_tokens.py.)"""

from __future__ import annotations

import asyncio
from importlib import import_module
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.accounts import socket_auth
from portal.accounts.models import ApiToken, Membership
from portal.accounts.streams import OpenStreams, still_allowed
from portal.sandboxes.models import Sandbox
from portal.telemetry.consumers import FleetSamples, GpuSamples, SandboxSamples
from portal.tunnels.consumers import SandboxTerminal
from tests.portal.helpers import client_for, place_all, request

pytestmark = [pytest.mark.usefixtures("on_commit_runs")]


@pytest.fixture
def sandboxes(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> dict[str, Any]:
    """Olivia's sandbox in Vision (Mark a member there) and Oscar's in NLP, both placed."""
    vision = request(people["owner"], people["project"], catalog["timeslice"], catalog["image"])
    nlp = request(people["outsider"], people["other_project"], catalog["timeslice"], catalog["image"])
    place_all()
    return {"vision": vision, "nlp": nlp, "gpu": nlp.allocations.get().gpu.uuid}


def _opened(consumer_class: type[Any], user: Any, **route: Any) -> Any:
    """A consumer as it stands once connected: the scope the session middleware gave it
    (the user signed in, its session), without a socket behind it."""
    key = client_for(user).cookies[settings.SESSION_COOKIE_NAME].value
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
    consumer = consumer_class()
    consumer.scope = {"user": user, "session": session, "url_route": {"kwargs": route}}
    return consumer


def _opened_with_token(user: Any, key_scopes: list[str], **route: Any) -> tuple[Any, str]:
    """A terminal opened by the command-line client's shell with a new token of ``user``'s."""
    _, key = ApiToken.issue(user, "shell", key_scopes)
    handshake = {"headers": [(b"authorization", f"Bearer {key}".encode())], "client": ("203.0.113.9", 1)}
    verdict = socket_auth.authenticate(f"Bearer {key}", handshake)
    assert not isinstance(verdict, socket_auth.Refusal), verdict
    terminal = SandboxTerminal()
    terminal.scope = {
        **handshake,
        "user": verdict[0],
        socket_auth.SCOPE_KEY: verdict[1],
        "url_route": {"kwargs": route},
    }
    return terminal, key


def _the_revocations(people: Any, sandboxes: dict[str, Any]) -> tuple[list[Any], list[bool]]:
    """One socket per way of losing access, each beside one that keeps it; what each should
    be answered after the changes this makes."""
    vision, nlp, gpu = sandboxes["vision"], sandboxes["nlp"], sandboxes["gpu"]
    Sandbox.objects.filter(pk=vision.pk).update(state="running")  # a terminal needs it running
    shell, _ = _opened_with_token(people["owner"], ["write:sandboxes"], sandbox_id=vision.pk)
    revoked_shell, revoked_key = _opened_with_token(
        people["owner"], ["write:sandboxes"], sandbox_id=vision.pk
    )
    kept = [
        _opened(SandboxSamples, people["owner"], sandbox_id=vision.pk),
        _opened(SandboxSamples, people["admin"], sandbox_id=nlp.pk),
        _opened(GpuSamples, people["admin"], uuid=gpu),
        _opened(FleetSamples, people["admin"]),
        _opened(SandboxTerminal, people["owner"], sandbox_id=vision.pk),
        shell,
    ]
    removed = _opened(SandboxSamples, people["member"], sandbox_id=vision.pk)
    signed_out = _opened(SandboxSamples, people["outsider"], sandbox_id=nlp.pk)
    ended = _opened(GpuSamples, people["outsider"], uuid=gpu)
    type(people["owner"]).objects.filter(pk=people["owner"].pk).update(is_staff=True)
    demoted = _opened(FleetSamples, type(people["owner"]).objects.get(pk=people["owner"].pk))
    type(people["owner"]).objects.filter(pk=people["owner"].pk).update(is_staff=False)
    gone_terminal = _opened(SandboxTerminal, people["outsider"], sandbox_id=nlp.pk)  # stopped below
    Membership.objects.filter(user=people["member"]).delete()
    ApiToken.objects.filter(key_prefix=revoked_key[:12]).update(revoked_at=timezone.now())
    signed_out.scope["session"].delete()
    Sandbox.objects.filter(pk=nlp.pk).update(state="stopped")
    nlp.allocations.update(active=False)
    lost = [removed, signed_out, ended, demoted, revoked_shell, gone_terminal]
    return kept + lost, [True] * len(kept) + [False] * len(lost)


@pytest.mark.django_db
def test_one_pass_answers_no_for_exactly_the_sockets_that_lost_access(
    people: Any, sandboxes: dict[str, Any]
) -> None:
    consumers, expected = _the_revocations(people, sandboxes)
    assert still_allowed(consumers) == expected
    # What each kept socket filters and adds is refreshed with its answer, as at connect.
    assert consumers[0].usage == list(sandboxes["vision"].usage.order_by("started_at", "pk"))
    assert consumers[2].only is None  # an admin sees every tenant's figures


@pytest.mark.django_db
def test_a_deactivated_user_loses_every_socket(people: Any, sandboxes: dict[str, Any]) -> None:
    mine = _opened(SandboxSamples, people["owner"], sandbox_id=sandboxes["vision"].pk)
    theirs = _opened(SandboxSamples, people["member"], sandbox_id=sandboxes["vision"].pk)
    type(people["owner"]).objects.filter(pk=people["owner"].pk).update(is_active=False)
    assert still_allowed([mine, theirs]) == [False, True]


@pytest.mark.django_db
def test_the_queries_of_a_pass_do_not_grow_with_the_open_sockets(
    people: Any, sandboxes: dict[str, Any]
) -> None:
    def queries_for(copies: int) -> int:
        consumers = [c for _ in range(copies) for c in _the_revocations(people, sandboxes)[0]]
        with CaptureQueriesContext(connection) as queries:
            still_allowed(consumers)
        return len(queries)

    few, many = queries_for(1), queries_for(25)
    # Who (sessions, users, tokens: 3), then each class's own bulk questions: sandbox streams
    # (sandboxes, memberships, usage, their hosts: 4), GPU streams (allocations, memberships,
    # their hosts: 3), terminals (running sandboxes, managers: 2), the fleet (its hosts: 1).
    assert few == many == 13, (few, many)


@pytest.mark.django_db(transaction=True)  # the pass reads on Channels' database thread
def test_the_registry_closes_the_revoked_and_keeps_watching_the_others(
    people: Any, sandboxes: dict[str, Any]
) -> None:
    consumers, expected = _the_revocations(people, sandboxes)
    closed: list[int] = []

    async def run() -> tuple[int, int, int]:
        registry = OpenStreams()
        for i, consumer in enumerate(consumers):

            async def revoked(i: int = i) -> None:
                closed.append(i)

            registry.watch(consumer, revoked)
        first = await registry.check_now()
        await asyncio.sleep(0)  # the closes run as their own tasks
        again = await registry.check_now()  # the revoked are no longer asked about
        registry.forget(consumers[0])  # a socket that went away is not asked about either
        watched = len(registry)
        for consumer in consumers[1:]:
            registry.forget(consumer)
        return first, again, watched

    first, again, watched = asyncio.run(run())
    assert sorted(closed) == [i for i, keep in enumerate(expected) if not keep]
    assert (first, again, watched) == (expected.count(False), 0, expected.count(True) - 1)
