"""Writing the audit log (``AuditEntry``): admin changes and changes made on someone's behalf.

- Catalog, quotas, projects, memberships, GPUs and user flags: every save or delete made
  while a signed-in person's request is being served is recorded with the values before
  and after, by model signals, whatever path it took (Django admin, the console, the API).
  Changes agents and workers make (inventory, heartbeats) have no person behind them and
  are not admin changes.
- Sandboxes: ``portal.sandboxes.actions`` records every transition and extension that a
  person made to a sandbox they do not own (an admin stopping it, a manager extending it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models.signals import post_delete, post_save, pre_save
from django.forms.models import model_to_dict
from django.http import HttpRequest, HttpResponse

from portal.audit.models import AuditEntry

_actor: ContextVar[Any] = ContextVar("audit_actor", default=None)
# Fields never copied into the log: secrets, and bookkeeping that changes on every sign-in.
SECRET_FIELDS = {"password", "last_login", "key_hash"}


def current_actor() -> Any:
    return _actor.get()


class AuditActorMiddleware:
    """Makes the signed-in person of a request the actor of what it changes."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        token = _actor.set(user if user is not None and user.is_authenticated else None)
        try:
            return self.get_response(request)
        finally:
            _actor.reset(token)


def snapshot(instance: models.Model) -> dict[str, Any]:
    values = {k: v for k, v in model_to_dict(instance).items() if k not in SECRET_FIELDS}
    return json.loads(json.dumps(values, cls=DjangoJSONEncoder, default=str))


def record(
    actor: Any,
    action: str,
    target: models.Model,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    message: str = "",
) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor if getattr(actor, "is_authenticated", False) else None,
        actor_name=actor.get_username() if getattr(actor, "is_authenticated", False) else "",
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
        message=message[:300],
    )


def _before(sender: type[models.Model], instance: models.Model, **_: Any) -> None:
    if current_actor() is None or instance.pk is None:
        return
    old = sender._default_manager.filter(pk=instance.pk).first()
    instance._audit_before = snapshot(old) if old is not None else None  # type: ignore[attr-defined]


def _after_save(sender: type[models.Model], instance: models.Model, created: bool, **_: Any) -> None:
    actor = current_actor()
    if actor is None:
        return
    before = None if created else getattr(instance, "_audit_before", None)
    after = snapshot(instance)
    if before == after:
        return  # saved without a change
    record(actor, "created" if created else "changed", instance, before, after)


def _after_delete(sender: type[models.Model], instance: models.Model, **_: Any) -> None:
    actor = current_actor()
    if actor is not None:
        record(actor, "deleted", instance, snapshot(instance), None)


def watch(*audited: type[models.Model]) -> None:
    for model in audited:
        uid = f"audit-{model._meta.label_lower}"
        pre_save.connect(_before, sender=model, dispatch_uid=f"{uid}-pre")
        post_save.connect(_after_save, sender=model, dispatch_uid=f"{uid}-post")
        post_delete.connect(_after_delete, sender=model, dispatch_uid=f"{uid}-delete")
