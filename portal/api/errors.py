"""The documented error answers, for ``extend_schema(responses=...)``."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, inline_serializer
from rest_framework import serializers

_DETAIL = inline_serializer("ErrorDetail", {"detail": serializers.CharField()})
_FIELD_ERRORS = OpenApiResponse(
    OpenApiTypes.OBJECT,
    description='Invalid input; each key names the field or parameter: {"field": ["message"]}.',
    examples=[OpenApiExample("field error", value={"tier": ["Object with slug=x does not exist."]})],
)

ERRORS: dict[int, Any] = {
    400: _FIELD_ERRORS,
    401: OpenApiResponse(_DETAIL, description="No credentials, or an invalid or revoked token."),
    403: OpenApiResponse(_DETAIL, description="Not allowed; names the missing token scope."),
    404: OpenApiResponse(_DETAIL, description="No such object among your projects, or a bad cursor."),
    429: OpenApiResponse(_DETAIL, description="Rate limited; retry after Retry-After seconds."),
}
POST_ERRORS: dict[int, Any] = {
    **ERRORS,
    422: OpenApiResponse(_DETAIL, description="Idempotency-Key reused for another request."),
}


def errors(*codes: int) -> dict[int, Any]:
    return {code: POST_ERRORS[code] for code in codes}
