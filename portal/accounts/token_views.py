"""The API tokens page: make a token (its key shown once), list and revoke yours; staff see
and revoke everyone's."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from portal.accounts.tokens import (
    DEFAULT_EXPIRY_DAYS,
    EXPIRY_DAYS,
    TokenError,
    do_issue_token,
    do_revoke_token,
    scopes_for,
    tokens_visible_to,
)
from portal.api.text import repeated_fields, text_problem, unknown_fields

_CHOOSE = {"invalid_choice": "Choose one of the listed options."}


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What will use it, e.g. billing-export")
    scopes = forms.MultipleChoiceField(widget=forms.CheckboxSelectMultiple, error_messages=_CHOOSE)
    expiry_days = forms.ChoiceField(
        choices=[(str(d), f"{d} days") for d in EXPIRY_DAYS],
        initial=str(DEFAULT_EXPIRY_DAYS),
        label="Expires after",
        error_messages=_CHOOSE,
    )

    def __init__(self, *args: Any, user: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user
        self.fields["scopes"].choices = scopes_for(user)  # type: ignore[attr-defined]

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"]
        if problem := text_problem(name, max_length=100):
            raise forms.ValidationError(problem)
        return name

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if extra := sorted(unknown_fields(self.data, [*self.fields, "csrfmiddlewaretoken"])):
            self.add_error(None, f"Unknown fields: {', '.join(extra)}.")
        for name, problems in repeated_fields(self.data).items():
            if name in self.fields and name != "scopes":  # scopes is a list by nature
                self.add_error(name, problems)
        return data


def _page(
    request: HttpRequest, form: TokenForm, new: Any = None, key: str = "", status: int = 200
) -> HttpResponse:
    mine = tokens_visible_to(request.user).filter(user=request.user)
    everyone = tokens_visible_to(request.user).exclude(user=request.user) if request.user.is_staff else None
    context = {"form": form, "mine": mine, "everyone": everyone, "new": new, "new_key": key}
    return render(request, "accounts/tokens.html", context, status=status)


@never_cache  # the page that shows a key must never sit in a cache
@login_required
def api_tokens(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _page(request, TokenForm(user=request.user))
    form = TokenForm(request.POST, user=request.user)
    if not form.is_valid():
        return _page(request, form, status=400)
    try:
        token, key = do_issue_token(
            request.user,
            form.cleaned_data["name"],
            form.cleaned_data["scopes"],
            int(form.cleaned_data["expiry_days"]),
        )
    except TokenError as exc:
        form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        return _page(request, form, status=400)
    # Shown in this answer only: not stored, not in the session, not in a redirect.
    return _page(request, TokenForm(user=request.user), new=token, key=key)


@login_required
@require_POST
def api_token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    token = do_revoke_token(request.user, pk)
    if token is None:
        raise Http404("No such token among yours.")
    messages.success(request, f"Token {token.name} ({token.key_prefix}…) is revoked.")
    return redirect("api-tokens")
