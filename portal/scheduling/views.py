"""The request form's live answer (htmx, ``/sandboxes/preview/``): the form is the sandboxes
app's, the answer the scheduling adapter's (``preview.py``)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from portal.catalog.models import Tier
from portal.catalog.sharing import TIMESLICE
from portal.catalog.storage import storage_lines
from portal.fleet.modes import most_replicas
from portal.inputs import whole_number
from portal.sandboxes.forms import SandboxRequestForm
from portal.scheduling.preview import Preview, offer_other_models, preview_by_model, preview_request


@login_required
@require_POST
def sandbox_preview(request: HttpRequest) -> HttpResponse:
    """The request form's live answer (htmx): would it start now, or wait, and why."""
    form = SandboxRequestForm(request.POST, user=request.user)
    tier_id = whole_number(request.POST.get("tier"))
    tier = Tier.objects.filter(pk=tier_id, active=True).first() if tier_id is not None else None
    if form.is_valid() and form.request_obj is not None:
        answer = preview_request(request.user, form.request_obj)
    elif unchosen := [form[n].label.lower() for n in CHOICES_FIRST if form.has_error(n, code="required")]:
        # A form not filled in yet (the preview also runs when the page loads) is not refused.
        answer = Preview("incomplete", f"Choose {_listed(unchosen)} to see whether it would start now.")
    else:
        problems = [
            f"{form[name].label}: {error}" if name in form.fields else str(error)
            for name, errors in form.errors.items()
            for error in errors
        ]
        answer = Preview("refused", "; ".join(problems))
    # The answer for each model the tier offers, when it offers a choice.
    by_model = preview_by_model(request.user, form.request_obj) if form.request_obj is not None else []
    answer = offer_other_models(answer, by_model)
    # The storage it would mount, with its usage: only for one of the user's own projects.
    project = getattr(form, "cleaned_data", {}).get("project")
    storage = storage_lines(tier, request.user, project) if tier is not None and project is not None else []
    # What its sharing mode gives and does not: a time-slice replica's with the fleet's count.
    replicas = most_replicas() if tier is not None and tier.sharing_mode == TIMESLICE else None
    return render(
        request,
        "sandboxes/_preview.html",
        {"preview": answer, "by_model": by_model, "tier": tier, "storage": storage, "replicas": replicas},
    )


CHOICES_FIRST = ("project", "tier", "image")


def _listed(words: list[str]) -> str:
    """ "a project, a tier and an image" """
    named = [f"{'an' if w[0] in 'aeiou' else 'a'} {w}" for w in words]
    return ", ".join(named[:-1]) + (" and " if len(named) > 1 else "") + named[-1]
