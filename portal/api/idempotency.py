"""``Idempotency-Key`` for API POSTs: the same key and body give the same answer once.

Clients should send a fresh key (a UUID) with every POST and the same key when they
retry it. The key row is inserted before the view runs, in the view's transaction: a
concurrent duplicate blocks on the unique index (user, key) until the first commits,
then finds the stored answer and replays it. Only successful answers are stored; an
error rolls the key back with everything else, so a corrected retry may reuse it.
Keys live 24 hours (``delete_expired_keys``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import exceptions, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.encoders import JSONEncoder

from portal.api.models import IdempotencyKey
from portal.api.text import text_problem

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255

PARAMETER = OpenApiParameter(
    HEADER,
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description=(
        "Send a unique key (e.g. a UUID) with every POST and the same key on a retry: a "
        "repeat with the same body returns the first answer (header Idempotent-Replayed: "
        "true) instead of acting twice; the same key with another body or path is refused "
        "(422). Keys are kept 24 hours. Optional, but clients should always send it."
    ),
)


class KeyReused(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_reused"


def _body_hash(request: Request) -> str:
    data = request.data
    if hasattr(data, "lists"):  # a QueryDict (form posts): keep repeated fields
        data = {k: v for k, v in data.lists()}
    canonical = json.dumps(data, sort_keys=True, cls=JSONEncoder, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def delete_expired_keys() -> int:
    """Drop keys older than 24 h; returns how many. Run periodically (control worker)."""
    deleted, _ = IdempotencyKey.objects.filter(created_at__lt=timezone.now() - IdempotencyKey.TTL).delete()
    return deleted


def _replay(row: IdempotencyKey, method: str, path: str, body_hash: str) -> Response:
    if (row.method, row.path, row.request_hash) != (method, path, body_hash):
        raise KeyReused(
            f"The {HEADER} {row.key!r} was already used for {row.method} {row.path} with another "
            "request body; send a new key for a new request."
        )
    return Response(row.response_body, status=row.response_status, headers={REPLAYED_HEADER: "true"})


def idempotent(view: Callable[..., Response]) -> Callable[..., Response]:
    """Wrap a DRF view method (self, request, ...) that handles a POST."""

    @functools.wraps(view)
    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.headers.get(HEADER)
        if key is None or not request.user.is_authenticated:
            return view(self, request, *args, **kwargs)
        if not key:
            raise exceptions.ValidationError({HEADER: [f"Give 1 to {MAX_KEY_LENGTH} characters."]})
        # The key is stored (PostgreSQL refuses NUL) and echoed in a 422: plain text only.
        if problem := text_problem(key, max_length=MAX_KEY_LENGTH):
            raise exceptions.ValidationError({HEADER: [problem]})
        method, path, body_hash = request.method or "POST", request.path[:255], _body_hash(request)
        expired = timezone.now() - IdempotencyKey.TTL
        IdempotencyKey.objects.filter(user=request.user, key=key, created_at__lt=expired).delete()
        with transaction.atomic():
            try:
                # A savepoint: a duplicate insert fails alone, the transaction goes on.
                with transaction.atomic():
                    row = IdempotencyKey.objects.create(
                        user=request.user, key=key, method=method, path=path, request_hash=body_hash
                    )
            except IntegrityError:
                # Another request holds or held this key; its insert has committed by now.
                return _replay(
                    IdempotencyKey.objects.get(user=request.user, key=key), method, path, body_hash
                )
            response = view(self, request, *args, **kwargs)
            if response.status_code >= 300:
                transaction.set_rollback(True)  # errors are not stored: a fixed retry may reuse the key
                return response
            row.response_status = response.status_code
            row.response_body = json.loads(json.dumps(response.data, cls=JSONEncoder))
            row.save(update_fields=["response_status", "response_body"])
        return response

    return wrapper
