"""Console → Hosts: enrolment from the portal, as ``manage.py host_credential`` does it.

An admin issues a GPU host (or an agent pool) its credentials, rotates them, or revokes them.
What an agent is given is shown once, in the answer to the POST that made it (never stored,
never put in a redirect or a message), with ``Cache-Control: no-store`` (``never_cache``);
each action is in the audit log.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from portal.audit.trail import record
from portal.fleet import credentials
from portal.fleet.models import Host, HostCredential
from portal.telemetry.models import Alert


class EnrolForm(forms.Form):
    host = forms.CharField(
        max_length=63,
        label="Host name",
        help_text="As its agent names itself (GPUSHARE_HOST; the unit uses the hostname).",
    )
    pool = forms.BooleanField(
        required=False,
        label="An agent pool",
        help_text="One process serving many simulated hosts: the name is the prefix theirs start with.",
    )


def _page(request: HttpRequest, form: EnrolForm | None = None, status: int = 200) -> HttpResponse:
    rows = list(HostCredential.objects.all())
    hosts = {h.name: h for h in Host.objects.filter(name__in=[c.host for c in rows if not c.pool])}
    open_forged = Alert.objects.filter(kind=Alert.Kind.FORGED, cleared_at__isnull=True)
    forged = {row["host__name"]: row["n"] for row in open_forged.values("host__name").annotate(n=Count("pk"))}
    enrolled = [
        {"credential": c, "host": hosts.get(c.host), "forged": 0 if c.pool else forged.get(c.host, 0)}
        for c in rows
    ]
    unenrolled = Host.objects.exclude(name__in=[c.host for c in rows if c.active and not c.pool])
    for credential in rows:  # hosts a pool covers are enrolled through it
        if credential.pool and credential.active:
            unenrolled = unenrolled.exclude(Q(name__startswith=credential.host))
    return render(
        request,
        "console/hosts.html",
        {"enrolled": enrolled, "unenrolled": unenrolled.order_by("name")[:50], "form": form or EnrolForm()},
        status=status,
    )


@staff_member_required
def hosts(request: HttpRequest) -> HttpResponse:
    return _page(request)


def _issued(
    request: HttpRequest, enrolment: credentials.Enrolment, pool: bool, rotated: bool
) -> HttpResponse:
    # never_cache on the views that call this: the answer is no-store.
    return render(
        request,
        "console/host_issued.html",
        {
            "enrolment": enrolment,
            "files": enrolment.files(),
            "pool": pool,
            "rotated": rotated,
        },
    )


@staff_member_required
@require_POST
@never_cache
def issue(request: HttpRequest) -> HttpResponse:
    form = EnrolForm(request.POST)
    if not form.is_valid():
        return _page(request, form, status=400)
    host, pool = form.cleaned_data["host"].strip(), form.cleaned_data["pool"]
    try:
        enrolment = credentials.issue(host, pool=pool)
    except credentials.CredentialError as exc:
        form.add_error("host", str(exc))
        return _page(request, form, status=400)
    _audit(request, host, "credential issued")
    return _issued(request, enrolment, pool, rotated=False)


@staff_member_required
@require_POST
@never_cache
def rotate(request: HttpRequest, host: str) -> HttpResponse:
    try:
        enrolment = credentials.rotate(host)
    except credentials.CredentialError as exc:
        messages.error(request, str(exc))
        return redirect("console-hosts")
    _audit(request, host, "credential rotated")
    pool = HostCredential.objects.filter(host=host, pool=True).exists()
    return _issued(request, enrolment, pool, rotated=True)


@staff_member_required
@require_POST
def revoke(request: HttpRequest, host: str) -> HttpResponse:
    try:
        credentials.revoke(host)
    except credentials.CredentialError as exc:
        messages.error(request, str(exc))
    else:
        _audit(request, host, "credential revoked")
        messages.success(
            request,
            f"{host}: revoked. Its agent is cut off from Redis and its key verifies nothing more; "
            "the host is marked lost once it has missed three heartbeats.",
        )
    return redirect("console-hosts")


def _audit(request: HttpRequest, host: str, action: str) -> None:
    credential: Any = HostCredential.objects.get(host=host)
    after = {"host": credential.host, "pool": credential.pool, "active": credential.active}
    record(
        request.user, action, credential, None, after, message="the secrets were shown once, to this admin"
    )
