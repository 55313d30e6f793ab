"""Notifications by email: which kinds each user wants mailed, and the sending.

``portal.sandboxes.notify`` writes a ``Notification`` inside the transaction of the change it
reports and hands its id to ``queue_after_commit``: once that transaction commits (never inside it, so
neither the scheduling cycle nor a web request waits on a mail server), the control task
``workers.control.email_notifications`` calls ``send_notification_emails``. That sends one
mail per notification whose user chose its kind (``EmailChoice``, else the defaults below)
and has an address, through Django's email backend: SMTP when ``EMAIL_HOST`` is set, else
the console backend, which prints it in the control worker's output.

Each mail is claimed before it is sent by a conditional UPDATE of ``emailed_at`` (from null
to now), and released when the send fails, so neither a retry nor a duplicate message sends
it twice. What the server may get over (no connection, a 4xx answer) is retried with the
webhooks' backoff, ``MAX_ATTEMPTS`` in all (about an hour); an address the server refuses
for good (5xx), or one that cannot be written in a header, is given up at once. Giving up
logs a WARNING naming the notification, the address and the problem. What SMTP itself
leaves open stays open: a worker killed between the claim and the send loses that mail, and
a server that took a message but timed out before saying so gets it again on the retry.
"""

from __future__ import annotations

import contextlib
import logging
import smtplib
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.core.mail.backends.base import BaseEmailBackend
from django.db import transaction
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from portal.sandboxes.models import EmailChoice, Notification
from portal.webhooks.deliveries import backoff_seconds
from wire.messages import to_control

log = logging.getLogger(__name__)
K = Notification.Kind

# Mailed unless the user chose otherwise: what changes whether their sandbox is there and
# running, or asks them to act before they lose work. Off: what they already saw or hear of
# often (the request form says at once why a request waits; a project near its quota is told
# at every request; a drained GPU or an alert leaves the sandbox running).
DEFAULT_EMAIL_KINDS = frozenset(
    {K.STARTED, K.PREEMPTED, K.FAILED, K.EXPIRING, K.ENDED, K.IDLE, K.CULLED, K.STORAGE, K.OVER_SHARE}
)
# What each kind tells, as the settings page offers it (every kind, in this order).
DESCRIPTIONS: dict[str, str] = {
    K.STARTED: "a sandbox starts running",
    K.QUEUED: "a request has to wait, and why",
    K.PREEMPTED: "a sandbox is preempted for higher-priority work (warned, stopped or queued again)",
    K.FAILED: "a sandbox fails",
    K.EXPIRING: "a sandbox is about to reach its time limit (you can still extend it)",
    K.ENDED: "a sandbox ends without you stopping it: it exited, expired or an admin stopped it",
    K.IDLE: "an idle sandbox is warned that it will be stopped",
    K.CULLED: "an idle sandbox was stopped",
    K.STORAGE: "your home or project folder nears or reaches its limit",
    K.OVER_SHARE: "a sandbox on a shared GPU holds more GPU memory than its share (warned, or stopped)",
    K.QUOTA: "your project nears a quota limit when you request a sandbox",
    K.DRAINED: "the GPU of a running sandbox is taken out of service",
    K.ALERT: "a GPU alert concerns your sandbox",
}

MAX_ATTEMPTS = 8  # with backoff_seconds: 30 s, 1, 2, 4, 8, 16, 32 min, about an hour in all
SEND_FOR_S = 60.0  # what a task has not sent by then goes to a new message (time limit 120 s)
SUBJECT_MAX = 150


# --- choices ---------------------------------------------------------------------------------


def email_kinds_by_user(user_ids: Iterable[int]) -> dict[int, set[str]]:
    """The kinds each user has mailed: their own choices over the defaults. One query."""
    chosen: dict[int, set[str]] = {pk: set(DEFAULT_EMAIL_KINDS) for pk in user_ids}
    rows = EmailChoice.objects.filter(user_id__in=list(chosen)).values_list("user_id", "kind", "by_email")
    for user_id, kind, by_email in rows:
        (chosen[user_id].add if by_email else chosen[user_id].discard)(kind)
    return chosen


def email_kinds(user_id: int) -> set[str]:
    return email_kinds_by_user([user_id])[user_id]


def do_set_email_kinds(user_id: int, kinds: Iterable[str]) -> None:
    """Record the user's choice for every kind: those in ``kinds`` by email, the rest not."""
    wanted = set(kinds)
    if unknown := wanted - set(K.values):
        raise ValueError(f"unknown notification kinds: {sorted(unknown)}")
    with transaction.atomic():
        for kind in K.values:
            EmailChoice.objects.update_or_create(
                user_id=user_id, kind=kind, defaults={"by_email": kind in wanted}
            )


# --- sending ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retry:
    """Notifications to try again after ``delay_s``."""

    ids: list[int]
    delay_s: float


def portal_url() -> str:
    return str(settings.PORTAL_URL).rstrip("/")


def message_for(note: Notification) -> EmailMessage:
    """The mail of one notification: what happened in the subject, the words and a link to
    the sandbox's page (else to the notifications page) in the body."""
    path = reverse("sandbox-detail", args=[note.sandbox_id]) if note.sandbox_id else reverse("notifications")
    subject = " ".join(f"[gpushare] {note.get_kind_display()}: {note.message}".split())
    if len(subject) > SUBJECT_MAX:
        subject = subject[: SUBJECT_MAX - 1] + "…"
    body = render_to_string(
        "sandboxes/notification_email.txt",
        {
            "note": note,
            "link": portal_url() + path,
            "settings_link": portal_url() + reverse("notification-email"),
            "user": note.user,
        },
    )
    # RFC 3834: an automatic message, which vacation responders should not answer.
    return EmailMessage(subject, body, to=[note.user.email], headers={"Auto-Submitted": "auto-generated"})


def problem(exc: BaseException) -> str:
    """What went wrong, in the words an operator searches for."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return "; ".join(
            f"{rcpt} refused: {code} {_text(msg)}" for rcpt, (code, msg) in exc.recipients.items()
        )
    if isinstance(exc, smtplib.SMTPResponseException):
        return f"{type(exc).__name__}: {exc.smtp_code} {_text(exc.smtp_error)}"
    return f"{type(exc).__name__}: {exc}"


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _refused_for_good(exc: BaseException) -> bool:
    """A 5xx for every recipient: the address does not exist there; no retry mends that."""
    return isinstance(exc, smtplib.SMTPRecipientsRefused) and all(
        code >= 500 for code, _ in exc.recipients.values()
    )


def to_mail(ids: list[int]) -> list[Notification]:
    """The notifications among ``ids`` still to be mailed: not mailed yet, of a kind their
    user chose, to an active user with an address."""
    notes = list(
        Notification.objects.filter(pk__in=ids, emailed_at=None)
        .select_related("user", "sandbox")
        .order_by("pk")
    )
    wanted = email_kinds_by_user({n.user_id for n in notes})
    return [n for n in notes if n.user.is_active and n.user.email and n.kind in wanted[n.user_id]]


def send_notification_emails(ids: list[int], attempt: int = 1) -> Retry | None:
    """Mail the notifications among ``ids`` that their users chose (this is the
    ``attempt``-th try for these ids); returns what to try again and when, or None."""
    todo = to_mail(ids)
    if not todo:
        return None
    failed: dict[int, str] = {}
    later: list[int] = []
    started = time.monotonic()
    connection = get_connection()  # one SMTP session for all of them
    try:
        connection.open()
        for note in todo:
            if time.monotonic() - started > SEND_FOR_S:
                later.append(note.pk)
            elif (error := _send_one(connection, note)) is not None:
                failed[note.pk] = error
    except (smtplib.SMTPException, OSError) as exc:  # no session: nothing was claimed
        failed = {n.pk: problem(exc) for n in todo}
    finally:
        with contextlib.suppress(smtplib.SMTPException, OSError):  # what was sent stays sent
            connection.close()
    if later:
        to_control.email_notifications(later)  # fresh attempts: none of these failed
    return _after_failures(todo, failed, attempt)


def _send_one(connection: BaseEmailBackend, note: Notification) -> str | None:
    """Claim, send, then keep the claim, or release it if the send failed. Returns the
    problem when it is worth another try."""
    claimed_at = timezone.now()
    if not Notification.objects.filter(pk=note.pk, emailed_at=None).update(emailed_at=claimed_at):
        return None  # mailed, or being mailed, by another message
    sent = False
    try:
        connection.send_messages([message_for(note)])
        sent = True
    except (smtplib.SMTPException, OSError) as exc:
        if not _refused_for_good(exc):
            return problem(exc)
        log.warning("notification %d: email to %s given up: %s", note.pk, note.user.email, problem(exc))
    except ValueError as exc:  # an address Django cannot put in a header: no retry mends it
        log.warning("notification %d: email to %r given up: %s", note.pk, note.user.email, exc)
    finally:
        if not sent:
            Notification.objects.filter(pk=note.pk, emailed_at=claimed_at).update(emailed_at=None)
    return None


def _after_failures(todo: list[Notification], failed: dict[int, str], attempt: int) -> Retry | None:
    if not failed:
        return None
    if attempt >= MAX_ATTEMPTS:
        for note in todo:
            if note.pk in failed:
                log.warning(
                    "notification %d: email to %s given up after %d attempts: %s",
                    note.pk, note.user.email, attempt, failed[note.pk],
                )  # fmt: skip
        return None
    delay = backoff_seconds(attempt)
    first = next(iter(failed.values()))
    log.info(
        "%d notification emails not sent (attempt %d of %d), trying again in %.0f s: %s",
        len(failed), attempt, MAX_ATTEMPTS, delay, first,
    )  # fmt: skip
    return Retry(sorted(failed), delay)
