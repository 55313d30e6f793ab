"""The account's SSH keys page: add a public key (a .pub file's line), list and remove yours.
Each user sees their own keys only, staff too: a key is a way into their sandboxes."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from portal.accounts.models import SshKey
from portal.accounts.ssh_keys import MAX_NAME, SshKeyError, do_add_key, do_remove_key
from portal.api.text import repeated_fields, unknown_fields
from wire.ssh import MAX_BLOB_CHARS


class SshKeyForm(forms.Form):
    public_key = forms.CharField(
        max_length=MAX_BLOB_CHARS + 400,
        strip=True,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "ssh-ed25519 AAAA… you@laptop"}),
        help_text="The line of your .pub file, e.g. ~/.ssh/id_ed25519.pub",
    )
    name = forms.CharField(max_length=MAX_NAME, required=False, help_text="Defaults to the key's comment")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if extra := sorted(unknown_fields(self.data, [*self.fields, "csrfmiddlewaretoken"])):
            self.add_error(None, f"Unknown fields: {', '.join(extra)}.")
        for name, problems in repeated_fields(self.data).items():
            if name in self.fields:
                self.add_error(name, problems)
        return data


def _page(request: HttpRequest, form: SshKeyForm, status: int = 200) -> HttpResponse:
    keys = SshKey.objects.filter(user_id=int(request.user.pk or 0))
    portal = f"{request.scheme}://{request.get_host()}"
    context = {"form": form, "keys": keys, "portal": portal}
    return render(request, "accounts/ssh_keys.html", context, status=status)


@never_cache
@login_required
def ssh_keys_page(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _page(request, SshKeyForm())
    form = SshKeyForm(request.POST)
    if not form.is_valid():
        return _page(request, form, status=400)
    try:
        key = do_add_key(request.user, form.cleaned_data["name"], form.cleaned_data["public_key"])
    except SshKeyError as exc:
        form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        return _page(request, form, status=400)
    messages.success(request, f"SSH key {key.name} ({key.fingerprint}) is added.")
    return redirect("ssh-keys")


@login_required
@require_POST
def ssh_key_remove(request: HttpRequest, pk: int) -> HttpResponse:
    key = do_remove_key(request.user, pk)
    if key is None:
        raise Http404("No such SSH key among yours.")
    messages.success(request, f"SSH key {key.name} ({key.fingerprint}) is removed.")
    return redirect("ssh-keys")
