"""A real SMTP server on loopback (aiosmtpd) that keeps what it is handed, and can refuse:
the portal's mails (password resets, notifications) go to it through Django's real SMTP
backend. The ``smtp`` fixture (tests/portal/conftest.py) starts one per test."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from email import message_from_bytes
from email.message import Message
from typing import Any

from aiosmtpd.controller import Controller
from django.test import override_settings


class Inbox:
    """aiosmtpd handler: keeps every message it accepts, as (recipients, message).

    ``data_answers`` are said to the next messages' DATA in turn (a ``4xx`` or ``5xx``
    refuses that message), ``250 OK`` once they run out; ``refused`` maps addresses to the
    answer their RCPT gets."""

    def __init__(self) -> None:
        self.messages: list[tuple[list[str], Message]] = []
        self.data_answers: list[str] = []
        self.refused: dict[str, str] = {}
        self.refusals = 0

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        if address in self.refused:
            self.refusals += 1
            return self.refused[address]
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        answer = self.data_answers.pop(0) if self.data_answers else "250 OK"
        if answer.startswith("250"):
            self.messages.append((list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
        else:
            self.refusals += 1
        return answer

    def subjects(self) -> list[str]:
        return [str(message["Subject"]) for _, message in self.messages]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def mail_settings(port: int) -> Any:
    """Django's real SMTP backend, pointed at ``port`` on loopback."""
    return override_settings(
        EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
        EMAIL_HOST="127.0.0.1",
        EMAIL_PORT=port,
        EMAIL_TIMEOUT=5,
        DEFAULT_FROM_EMAIL="gpushare <noreply@gpus.example.test>",
    )


@contextmanager
def smtp_server() -> Iterator[Inbox]:
    """An SMTP server on a free loopback port, and the settings that send to it."""
    port = free_port()
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        with mail_settings(port):
            yield inbox
    finally:
        controller.stop()
