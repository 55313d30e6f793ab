"""Cursor pages (REST_FRAMEWORK's default pagination) whose size and cursor are checked."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.utils import timezone
from rest_framework import exceptions, pagination
from rest_framework.request import Request

from portal.api.text import MAX_PARAM_LENGTH, text_problem
from portal.inputs import whole_number

MAX_PAGE_SIZE = 1000


def checked_page_size(request: Request, default: int | None) -> int | None:
    """``?page_size=`` as a whole number 1..MAX_PAGE_SIZE; DRF would quietly fall back to the
    default for a bad one, which hides the mistake from the caller."""
    raw = request.query_params.get("page_size")
    if raw is None:
        return default
    size = whole_number(raw, 1, MAX_PAGE_SIZE)
    if size is None:
        raise exceptions.ValidationError({"page_size": [f"Give a whole number from 1 to {MAX_PAGE_SIZE}."]})
    return size


class CheckedPageSize(pagination.CursorPagination):
    """Cursor pages whose size and cursor are checked: DRF decodes a cursor's base64 but
    hands its position straight to the database, so a forged one ("p=yesterday" on a time
    ordering, a number past bigint) was a 500. A position its ordering field cannot hold is
    the documented 404 "Invalid cursor"."""

    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE_SIZE
    _model: Any = None

    def get_page_size(self, request: Request) -> int | None:
        return checked_page_size(request, self.page_size)

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        self._model = queryset.model
        return super().paginate_queryset(queryset, request, view)

    def decode_cursor(self, request: Request) -> pagination.Cursor | None:
        cursor = super().decode_cursor(request)
        if cursor is None or cursor.position is None:
            return cursor
        try:
            position = _cursor_position(self._model, self.ordering[0].lstrip("-"), str(cursor.position))
        except (ValidationError, FieldDoesNotExist, ValueError, TypeError, OverflowError):
            raise exceptions.NotFound(self.invalid_cursor_message) from None
        return pagination.Cursor(offset=cursor.offset, reverse=cursor.reverse, position=position)


_BIGINT = 2**63


def _cursor_position(model: Any, path: str, raw: str) -> Any:
    """``raw`` as a value of the field at ``path`` (``project__slug``...), or an error."""
    *relations, name = path.split("__")
    for relation in relations:
        model = model._meta.get_field(relation).related_model
    field = model._meta.get_field(name)
    if name.endswith("_id") or field.is_relation:
        field = field.target_field
    if text_problem(raw, max_length=MAX_PARAM_LENGTH):
        raise ValueError(raw)
    value = field.to_python(raw)
    if value is None or (isinstance(value, int) and not -_BIGINT <= value < _BIGINT):
        raise ValueError(raw)
    if isinstance(value, datetime):  # PostgreSQL refuses offsets it does not know
        value = value.replace(tzinfo=UTC) if timezone.is_naive(value) else value.astimezone(UTC)
    return value


class NewestFirst(CheckedPageSize):
    """Stable cursor pages even while new rows arrive: ordered by start time, then id."""

    ordering = ("-started_at", "-id")


class NewestRequestFirst(NewestFirst):
    ordering = ("-requested_at", "-id")


class BySlug(NewestFirst):
    ordering = ("slug",)  # type: ignore[assignment]
