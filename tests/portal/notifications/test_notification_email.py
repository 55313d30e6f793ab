"""Notifications by email (portal.notifications.emails): each kind a user chose arrives at a real
SMTP server on loopback (aiosmtpd), made by the code path that makes that notification
and sent by the control worker's real task after commit; kinds not chosen, users without
an address and changes rolled back send nothing; a server that refuses is retried and
nothing is sent twice; the settings page is each user's own."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from email.message import Message
from typing import Any

import pytest
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone

from portal.control import tasks
from portal.notifications import emails
from portal.quotas.models import QuotaPolicy
from portal.sandboxes import actions, notify
from portal.sandboxes.models import EmailChoice, Notification, Sandbox
from tests.factories import PriorityClassFactory, TierFactory
from tests.portal.helpers import client_for, place_all, request
from tests.portal.smtp import Inbox
from wire.spec import HandleJson

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs", "fleet")]
Sent = list[tuple[str, str, tuple[Any, ...]]]


def deliver(sent_tasks: Sent) -> int:
    """Run the control worker's mail task on every message queued so far, through Celery's
    ``apply`` (its retries run at once, without their countdown). Returns the runs."""
    from workers import control

    runs = 0
    while batch := [args for _, task, args in sent_tasks if task == "email_notifications"]:
        sent_tasks[:] = [t for t in sent_tasks if t[1] != "email_notifications"]
        for args in batch:
            control.TASKS["email_notifications"].apply(args=args).get()
            runs += 1
    return runs


def handle(sandbox: Sandbox, ref: str) -> HandleJson:
    """What the sandbox's agent reports it launched (a container)."""
    return HandleJson(driver="docker", allocation_key=sandbox.allocation_key, sandbox_id=sandbox.pk, ref=ref)


def mails_to(inbox: Inbox, address: str) -> list[Message]:
    return [message for recipients, message in inbox.messages if recipients == [address]]


def choose(user: Any, *kinds: str) -> None:
    emails.do_set_email_kinds(user.pk, kinds)


def running(people: Any, catalog: Any, tier: Any = None, **kw: Any) -> Sandbox:
    """Requested, placed by the cycle and reported running by its agent (the control task)."""
    sandbox = request(
        people["owner"], people["project"], tier or catalog["dedicated"], catalog["image"], **kw
    )
    place_all()
    sandbox.refresh_from_db()
    tasks.sandbox_launched(sandbox.allocation_key, handle(sandbox, "c"), int(time.time() * 1000))
    sandbox.refresh_from_db()
    return sandbox


def host_of(sandbox: Sandbox) -> str:
    assert sandbox.host is not None
    return sandbox.host.name


OWNER = "olivia@example.org"  # the factory's address for the owner


# --- each kind, from the code that makes it ----------------------------------------------


def test_a_start_is_mailed_with_what_happened_and_a_link_to_the_sandbox(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    with override_settings(PORTAL_URL="https://gpus.example.test/"):
        sandbox = running(people, catalog)
        assert deliver(sent_tasks) >= 1
    [mail] = mails_to(smtp, OWNER)
    assert mail["Subject"] == f"[gpushare] Started: Sandbox {sandbox.pk} is running on {host_of(sandbox)}."
    assert mail["Auto-Submitted"] == "auto-generated"
    assert mail["From"] == "gpushare <noreply@gpus.example.test>"
    body = mail.get_payload()
    assert isinstance(body, str)
    assert f"Sandbox {sandbox.pk} is running on {host_of(sandbox)}." in body
    assert f"https://gpus.example.test/sandboxes/{sandbox.pk}/" in body
    assert "https://gpus.example.test/account/notifications/" in body
    note = Notification.objects.get(sandbox=sandbox, kind="started")
    assert note.emailed_at is not None


def test_a_wait_and_its_reason_is_mailed_once_from_the_cycles_bulk_path(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    choose(people["owner"], "queued")  # off by default: the request form already says why
    waiting = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=4)
    place_all()
    place_all()  # a second cycle refines the reason: no second notification, no second mail
    deliver(sent_tasks)
    [mail] = mails_to(smtp, OWNER)
    assert mail["Subject"].startswith(f"[gpushare] Queued: Sandbox {waiting.pk} waits: ")
    assert f"/sandboxes/{waiting.pk}/" in str(mail.get_payload())


def test_a_preemption_warning_is_mailed(people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox) -> None:
    batch = TierFactory(
        slug="batch",
        sharing_mode="dedicated",
        priority_class=PriorityClassFactory(name="batch", value=10, preemptible=True),
        preempt_after=timedelta(minutes=10),
        preempt_grace=timedelta(seconds=90),
    )
    choose(people["owner"], "preempted")
    fillers = [request(people["owner"], people["project"], batch, catalog["image"]) for _ in range(4)]
    place_all()
    an_hour_ago = timezone.now() - timedelta(hours=1)
    for sandbox in fillers:
        sandbox.refresh_from_db()
        actions.do_mark_running(sandbox.allocation_key, {"driver": "docker", "ref": "x"}, an_hour_ago)
    request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    place_all()  # the cycle preempts one filler for the outsider's request
    deliver(sent_tasks)
    [mail] = mails_to(smtp, OWNER)
    [victim] = Sandbox.objects.filter(preempted_for__isnull=False)
    assert mail["Subject"].startswith(f"[gpushare] Preempted: Sandbox {victim.pk} is preempted")
    assert "Save your work now" in str(mail.get_payload())


def test_a_failed_launch_is_mailed(people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    tasks.sandbox_launch_failed(sandbox.pk, sandbox.allocation_key, "image not on this host")
    deliver(sent_tasks)
    [mail] = mails_to(smtp, OWNER)
    assert (
        mail["Subject"] == f"[gpushare] Failed: Sandbox {sandbox.pk}: launch failed: image not on this host"
    )


def test_the_expiry_warning_has_its_own_kind_and_is_mailed(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    sandbox = running(people, catalog, duration=timedelta(hours=1))
    Sandbox.objects.filter(pk=sandbox.pk).update(started_at=timezone.now() - timedelta(minutes=50))
    choose(people["owner"], "expiring")  # only the warning: the start above is not mailed
    actions.do_expire_overdue(timezone.now())
    deliver(sent_tasks)
    [mail] = mails_to(smtp, OWNER)
    assert mail["Subject"].startswith(f"[gpushare] Expiring: Sandbox {sandbox.pk} reaches its time limit at")
    assert "extend it to keep it" in str(mail.get_payload())
    page = client_for(people["owner"]).get("/notifications/").content.decode()
    assert '<span class="badge">Expiring</span>' in page and "kind-expiring" in page


def test_an_end_the_owner_did_not_cause_is_mailed(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    sandbox = running(people, catalog)
    tasks.sandbox_stopped(sandbox.allocation_key, int(time.time() * 1000), "exited with code 0")
    deliver(sent_tasks)
    subjects = [str(m["Subject"]) for m in mails_to(smtp, OWNER)]
    assert subjects[-1] == f"[gpushare] Ended: Sandbox {sandbox.pk}: exited with code 0"


def test_a_request_near_the_quota_is_mailed(people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox) -> None:
    choose(people["owner"], "quota")
    QuotaPolicy.objects.create(project=people["project"], max_live_sandboxes=2, max_gpus=8)
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    deliver(sent_tasks)
    [mail] = mails_to(smtp, OWNER)
    assert mail["Subject"] == "[gpushare] Quota: Project Vision uses 2 of its 2 live sandboxes."


# --- who gets nothing ------------------------------------------------------------------------


def test_kinds_not_chosen_are_shown_in_the_portal_but_not_mailed(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    choose(people["owner"], "failed")  # everything else off
    sandbox = running(people, catalog)
    tasks.sandbox_stopped(sandbox.allocation_key, int(time.time() * 1000), "exited with code 0")
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"], gpu_count=4)
    place_all()  # waits: queued is off by default and here
    deliver(sent_tasks)
    assert set(Notification.objects.filter(user=people["owner"]).values_list("kind", flat=True)) == {
        "started",
        "ended",
        "queued",
    }
    assert smtp.messages == []
    assert not Notification.objects.filter(emailed_at__isnull=False).exists()


def test_a_user_without_an_address_gets_nothing_and_nothing_fails(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    people["owner"].email = ""
    people["owner"].save()
    running(people, catalog)
    assert deliver(sent_tasks) == 1  # the task ran, and had nothing to send
    assert smtp.messages == []


def test_each_user_hears_of_their_own_only(people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox) -> None:
    running(people, catalog)
    request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    place_all()
    theirs = Sandbox.objects.get(owner=people["outsider"])
    tasks.sandbox_launched(theirs.allocation_key, handle(theirs, "d"), int(time.time() * 1000))
    deliver(sent_tasks)
    assert sorted(recipients[0] for recipients, _ in smtp.messages) == [OWNER, "oscar@example.org"]


def test_a_change_rolled_back_queues_no_mail(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    sent_tasks.clear()
    with transaction.atomic():
        notify.notify_owner(sandbox, Notification.Kind.STARTED, "never happened")
        assert not [t for t in sent_tasks if t[1] == "email_notifications"]  # not inside the transaction
        transaction.set_rollback(True)
    assert not [t for t in sent_tasks if t[1] == "email_notifications"]
    with transaction.atomic():
        notify.notify_owner(sandbox, Notification.Kind.STARTED, "happened")
    note = Notification.objects.get(message="happened")
    assert ("control", "email_notifications", ([note.pk],)) in sent_tasks


# --- a server that refuses --------------------------------------------------------------------


def test_a_refusing_server_is_retried_and_nothing_is_sent_twice(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    first, second = running(people, catalog), running(people, catalog)
    ids = list(Notification.objects.filter(kind="started").order_by("pk").values_list("pk", flat=True))
    sent_tasks.clear()
    # The first mail is taken, the second refused twice for now (451: try again later).
    smtp.data_answers = ["250 OK", "451 4.3.0 Try again later", "451 4.3.0 Try again later"]
    from workers import control

    control.TASKS["email_notifications"].apply(args=(ids,)).get()  # the task and its two retries
    assert smtp.refusals == 2
    subjects = sorted(str(m["Subject"]) for m in mails_to(smtp, OWNER))
    assert subjects == sorted(
        f"[gpushare] Started: Sandbox {s.pk} is running on {host_of(s)}." for s in (first, second)
    )
    control.TASKS["email_notifications"].apply(args=(ids,)).get()  # a duplicate message
    assert emails.send_notification_emails(ids) is None  # and a late retry
    assert len(smtp.messages) == 2  # still one each
    assert Notification.objects.filter(pk__in=ids, emailed_at__isnull=True).count() == 0


def test_a_failed_send_asks_for_a_retry_with_backoff_and_releases_its_claim(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox
) -> None:
    running(people, catalog)
    [note] = Notification.objects.filter(kind="started")
    smtp.data_answers = ["421 4.3.2 Service not available"]
    retry = emails.send_notification_emails([note.pk], attempt=1)
    assert retry is not None and retry.ids == [note.pk] and 24 <= retry.delay_s <= 36  # 30 s +-20 %
    note.refresh_from_db()
    assert note.emailed_at is None and smtp.messages == []
    later = emails.send_notification_emails([note.pk], attempt=3)
    assert later is None and len(smtp.messages) == 1


def test_a_server_that_is_not_there_is_given_up_with_a_line_naming_the_problem(
    people: Any, catalog: Any, sent_tasks: Sent, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.portal.smtp import free_port, mail_settings

    running(people, catalog)
    [note] = Notification.objects.filter(kind="started")
    sent_tasks.clear()
    from workers import control

    with mail_settings(free_port()), caplog.at_level(logging.INFO, logger="portal.notifications.emails"):
        control.TASKS["email_notifications"].apply(
            args=([note.pk],)
        ).get()  # every retry refused a connection
    given_up = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
    assert given_up == [
        f"notification {note.pk}: email to {OWNER} given up after {emails.MAX_ATTEMPTS} attempts: "
        "ConnectionRefusedError: [Errno 111] Connection refused"
    ]
    retried = [r for r in caplog.records if "trying again in" in r.getMessage()]
    assert len(retried) == emails.MAX_ATTEMPTS - 1
    note.refresh_from_db()
    assert note.emailed_at is None


def test_an_address_refused_for_good_is_not_retried(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    smtp.refused[OWNER] = "550 5.1.1 No such user here"
    running(people, catalog)
    [note] = Notification.objects.filter(kind="started")
    with caplog.at_level(logging.WARNING, logger="portal.notifications.emails"):
        assert emails.send_notification_emails([note.pk]) is None
    assert smtp.refusals == 1 and smtp.messages == []
    assert f"email to {OWNER} given up: {OWNER} refused: 550 5.1.1 No such user here" in caplog.text


def test_an_address_that_cannot_be_written_is_given_up_and_the_rest_still_sent(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    running(people, catalog)
    people["outsider"].email = "oscar@example.org\nBcc: everyone@example.org"  # header injection
    people["outsider"].save()
    request(people["outsider"], people["other_project"], catalog["dedicated"], catalog["image"])
    place_all()
    theirs = Sandbox.objects.get(owner=people["outsider"])
    tasks.sandbox_launched(theirs.allocation_key, handle(theirs, "d"), int(time.time() * 1000))
    ids = sorted(Notification.objects.filter(kind="started").values_list("pk", flat=True))
    with caplog.at_level(logging.WARNING, logger="portal.notifications.emails"):
        assert emails.send_notification_emails(ids) is None
    assert [recipients for recipients, _ in smtp.messages] == [[OWNER]]
    assert "email to 'oscar@example.org\\nBcc: everyone@example.org' given up" in caplog.text
    assert Notification.objects.get(sandbox=theirs, kind="started").emailed_at is None


def test_what_a_task_has_no_time_left_for_goes_to_a_new_message(
    people: Any, catalog: Any, sent_tasks: Sent, smtp: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    running(people, catalog)
    [note] = Notification.objects.filter(kind="started")
    sent_tasks.clear()
    kept = emails.SEND_FOR_S
    monkeypatch.setattr(emails, "SEND_FOR_S", -1.0)  # out of time before the first mail
    assert emails.send_notification_emails([note.pk]) is None  # nothing failed: no retry
    assert smtp.messages == [] and sent_tasks == [("control", "email_notifications", ([note.pk],))]
    monkeypatch.setattr(emails, "SEND_FOR_S", kept)  # not undo(): it would undo the fixtures' patches
    deliver(sent_tasks)
    assert len(smtp.messages) == 1


# --- choices ---------------------------------------------------------------------------------


def test_defaults_apply_until_a_user_chooses_and_every_kind_is_recorded_then(people: Any) -> None:
    owner = people["owner"]
    assert emails.email_kinds(owner.pk) == set(emails.DEFAULT_EMAIL_KINDS)
    assert {"started", "preempted", "failed", "expiring", "ended"} <= emails.DEFAULT_EMAIL_KINDS
    assert not {"queued", "quota"} & emails.DEFAULT_EMAIL_KINDS
    choose(owner, "queued", "quota")
    assert emails.email_kinds(owner.pk) == {"queued", "quota"}
    assert EmailChoice.objects.filter(user=owner).count() == len(Notification.Kind.values)
    assert emails.email_kinds(people["member"].pk) == set(emails.DEFAULT_EMAIL_KINDS)  # untouched
    with pytest.raises(ValueError, match="unknown notification kinds"):
        emails.do_set_email_kinds(owner.pk, ["started", "sms"])
    assert set(emails.DESCRIPTIONS) == set(Notification.Kind.values)  # the page offers every kind


# --- the settings page -------------------------------------------------------------------------


def test_the_page_shows_the_choices_the_address_and_whether_mail_is_sent(people: Any) -> None:
    owner = client_for(people["owner"])
    with override_settings(EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend"):
        page = owner.get("/account/notifications/").content.decode()
    assert f"Mail goes to <strong>{OWNER}</strong>" in page
    assert "This server sends no mail" not in page
    assert 'value="started" id="kind-started" checked' in page
    assert 'value="queued" id="kind-queued">' in page  # off by default
    assert 'href="/account/notifications/">Email</a>' in page  # linked from the top bar

    with override_settings(EMAIL_BACKEND="django.core.mail.backends.console.EmailBackend"):
        page = owner.get("/account/notifications/").content.decode()
    assert "This server sends no mail" in page and "writes each mail to its log" in page

    people["member"].email = ""
    people["member"].save()
    page = client_for(people["member"]).get("/account/notifications/").content.decode()
    assert "Your account has no email address" in page


def test_saving_records_the_choice_and_bad_input_is_a_form_error(people: Any) -> None:
    owner = client_for(people["owner"])
    saved = owner.post("/account/notifications/", {"kinds": ["failed", "expiring"]}, follow=True)
    assert saved.redirect_chain == [("/account/notifications/", 302)]
    assert "Saved. By email: failed, expiring." in saved.content.decode()
    assert emails.email_kinds(people["owner"].pk) == {"failed", "expiring"}
    page = saved.content.decode()
    assert 'value="failed" id="kind-failed" checked' in page and 'value="started" id="kind-started">' in page

    nothing = owner.post("/account/notifications/", {}, follow=True)
    assert "Saved. No notification is emailed." in nothing.content.decode()
    assert emails.email_kinds(people["owner"].pk) == set()

    bad = owner.post("/account/notifications/", {"kinds": ["started", "carrier-pigeon"]})
    assert bad.status_code == 400 and "Choose among the listed kinds of notification." in bad.content.decode()
    assert emails.email_kinds(people["owner"].pk) == set()  # unchanged


def test_no_one_changes_another_users_choices(people: Any) -> None:
    choose(people["owner"], "started")
    outsider = client_for(people["outsider"])
    answer = outsider.post("/account/notifications/", {"kinds": ["queued"], "user": str(people["owner"].pk)})
    assert answer.status_code == 400 and "Unknown fields: user." in answer.content.decode()
    assert emails.email_kinds(people["owner"].pk) == {"started"}
    outsider.post("/account/notifications/", {"kinds": ["queued"]})
    assert emails.email_kinds(people["owner"].pk) == {"started"}  # only the outsider's own changed
    assert emails.email_kinds(people["outsider"].pk) == {"queued"}

    anonymous = Client()
    assert anonymous.get("/account/notifications/").status_code == 302
    assert anonymous.post("/account/notifications/", {"kinds": ["queued"]}).status_code == 302
    checked = Client(enforce_csrf_checks=True)
    checked.force_login(people["owner"])
    assert checked.post("/account/notifications/", {"kinds": ["queued"]}).status_code == 403
    assert emails.email_kinds(people["owner"].pk) == {"started"}
