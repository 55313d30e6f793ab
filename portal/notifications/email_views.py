"""The signed-in user's email choices: which kinds of notification also arrive by email,
where they go, and whether this server sends mail at all. Only ever the user's own."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from portal.api.text import unknown_fields
from portal.notifications.emails import DEFAULT_EMAIL_KINDS, DESCRIPTIONS, do_set_email_kinds, email_kinds
from portal.sandboxes.models import Notification

# Backends that take a mail and deliver it nowhere: the page says so rather than promise mail.
NO_MAIL_BACKENDS = {
    "django.core.mail.backends.console.EmailBackend": "writes each mail to its log instead of sending it",
    "django.core.mail.backends.dummy.EmailBackend": "drops every mail",
    "django.core.mail.backends.filebased.EmailBackend": "writes each mail to a file instead of sending it",
    "django.core.mail.backends.locmem.EmailBackend": "keeps each mail in memory instead of sending it",
}


class EmailChoicesForm(forms.Form):
    kinds = forms.MultipleChoiceField(
        choices=[(kind, Notification.Kind(kind).label) for kind in DESCRIPTIONS],
        widget=forms.CheckboxSelectMultiple,
        required=False,  # none ticked: no mail at all, a valid choice
        error_messages={"invalid_choice": "Choose among the listed kinds of notification."},
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if extra := sorted(unknown_fields(self.data, ["kinds", "csrfmiddlewaretoken"])):
            self.add_error(None, f"Unknown fields: {', '.join(extra)}. This page sets your own choices only.")
        return data


def _page(request: HttpRequest, form: EmailChoicesForm, status: int = 200) -> HttpResponse:
    kinds = [
        {
            "value": kind,
            "label": Notification.Kind(kind).label,
            "description": description,
            "by_default": kind in DEFAULT_EMAIL_KINDS,
        }
        for kind, description in DESCRIPTIONS.items()
    ]
    context = {
        "form": form,
        "kinds": kinds,
        "ticked": set(form["kinds"].value() or []),
        "address": getattr(request.user, "email", ""),
        "no_mail": NO_MAIL_BACKENDS.get(settings.EMAIL_BACKEND, ""),
    }
    return render(request, "sandboxes/email_settings.html", context, status=status)


@login_required
def notification_email(request: HttpRequest) -> HttpResponse:
    user_id = int(request.user.pk or 0)
    if request.method != "POST":
        return _page(request, EmailChoicesForm(initial={"kinds": sorted(email_kinds(user_id))}))
    form = EmailChoicesForm(request.POST)
    if not form.is_valid():
        return _page(request, form, status=400)
    chosen = form.cleaned_data["kinds"]
    do_set_email_kinds(user_id, chosen)
    named = ", ".join(str(Notification.Kind(k).label).lower() for k in DESCRIPTIONS if k in chosen)
    messages.success(
        request, f"Saved. By email: {named}." if chosen else "Saved. No notification is emailed."
    )
    return redirect("notification-email")
