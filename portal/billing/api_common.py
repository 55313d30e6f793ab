"""What every API view shares: filters by project, user, tier and period; cursor pages;
the documented error answers."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db.models import QuerySet
from django.http import QueryDict
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, inline_serializer
from rest_framework import exceptions, pagination, parsers, serializers
from rest_framework.request import Request

from portal.inputs import whole_number

MAX_PAGE_SIZE = 1000
# Query values are slugs, usernames, ISO times and cursors: far shorter than this. A longer
# one is a mistake or a probe, and is refused rather than sent to the database.
MAX_PARAM_LENGTH = 255
MAX_CURSOR_LENGTH = 1000


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


def _printable(text: str) -> str:
    """``text`` safe to echo in an error message: short, no control or surrogate characters."""
    shown = text[:40].encode("utf-8", "backslashreplace").decode()
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)


# Unicode's bidirectional controls (embeddings, overrides, isolates, marks): they reorder
# what a reader sees, so "echo \u202egnp.exe" shows as "echo exe.png" (Trojan Source).
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def text_problem(value: str, *, max_length: int = MAX_PARAM_LENGTH, multiline: bool = False) -> str | None:
    """Why ``value`` cannot be taken as text (None when it can): too long, a NUL (PostgreSQL
    refuses it), a lone surrogate (not UTF-8: the database driver and the JSON renderer
    fail on it), another control character, or a bidirectional control."""
    if len(value) > max_length:
        return f"Too long: {len(value)} characters, at most {max_length}."
    if "\x00" in value:
        return "Null characters are not allowed."
    for char in value:
        if unicodedata.category(char) == "Cs":
            return "Not valid Unicode text (a lone surrogate)."
        if unicodedata.category(char) == "Cc" and not (multiline and char in "\t\n\r"):
            return f"Control characters (such as {char!r}) are not allowed."
        if char in BIDI_CONTROLS:
            return f"Bidirectional text controls (such as U+{ord(char):04X}) are not allowed."
    return None


def check_query(params: Any, allowed: Iterable[str]) -> None:
    """Refuse unknown, repeated, oversized or non-text query parameters, naming each."""
    allowed = set(allowed)
    problems: dict[str, list[str]] = {}
    for name in params:
        values = params.getlist(name)
        shown = _printable(name)
        if name not in allowed:
            known = ", ".join(sorted(allowed))
            problems[shown] = [f"Unknown parameter; this route takes {known}."]
        elif len(values) > 1:
            problems[shown] = ["Given more than once; give it once."]
        else:
            limit = MAX_CURSOR_LENGTH if name == "cursor" else MAX_PARAM_LENGTH
            if problem := text_problem(values[0], max_length=limit):
                problems[shown] = [problem]
    if problems:
        raise exceptions.ValidationError(problems)


def unknown_fields(data: Any, allowed: Iterable[str]) -> dict[str, list[str]]:
    """An error per body field the route does not take: ignoring one (``privileged``,
    ``volumes``...) would let the caller believe it was applied."""
    if not isinstance(data, Mapping):
        return {}
    allowed = sorted(allowed)
    known = ", ".join(allowed) if allowed else "no fields"
    return {
        _printable(str(name)): [f"Unknown field; this request takes {known}."]
        for name in data
        if name not in allowed
    }


def repeated_fields(data: Any) -> dict[str, list[str]]:
    """A form body's fields given more than once (a JSON body cannot repeat: StrictJSONParser)."""
    if not hasattr(data, "lists"):
        return {}
    return {_printable(k): ["Given more than once; give it once."] for k, v in data.lists() if len(v) > 1}


def refuse_unexpected_fields(data: Any, allowed: Iterable[str]) -> None:
    """A 400 naming every field the route does not take or that is given twice."""
    if problems := {**repeated_fields(data), **unknown_fields(data, allowed)}:
        raise exceptions.ValidationError(problems)


class StrictSerializer(serializers.Serializer[Any]):
    """A request body serializer that refuses fields it does not have, or has twice."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        refuse_unexpected_fields(data, self.fields)
        return super().to_internal_value(data)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise exceptions.ValidationError({_printable(key): ["Given more than once; give it once."]})
        seen[key] = value
    return seen


MAX_JSON_DEPTH = 32  # request bodies are flat objects; deeper nesting is a probe


def _checked_json(data: Any) -> None:
    """Refuse lone surrogates (``"\\ud800"`` parses, then fails in the database driver) and
    nesting deeper than MAX_JSON_DEPTH, walking the document without recursion (a deep one
    would raise RecursionError: a 500). An error names the top-level field it is under."""
    stack: list[tuple[Any, str, int]] = [(data, "non_field_errors", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise exceptions.ValidationError({where: [f"Nested more than {MAX_JSON_DEPTH} levels deep."]})
        if isinstance(value, str):
            if any(unicodedata.category(c) == "Cs" for c in value):
                raise exceptions.ValidationError({where: ["Not valid Unicode text (a lone surrogate)."]})
        elif isinstance(value, dict):
            for key, item in value.items():
                field = _printable(key) if depth == 0 else where
                stack += [(key, where, depth + 1), (item, field, depth + 1)]
        elif isinstance(value, list):
            stack += [(item, where, depth + 1) for item in value]


class Text(serializers.CharField):
    """A CharField refusing what ``text_problem`` refuses (NUL, lone surrogates, control
    characters, oversized), so that such a value is a 400 on its field, never a 500."""

    def __init__(self, *, multiline: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", MAX_PARAM_LENGTH)
        self.multiline = multiline
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):  # DRF would turn 12 or 1.5 into "12" or "1.5"
            self.fail("invalid")
        value = super().to_internal_value(data)
        limit = self.max_length or MAX_PARAM_LENGTH
        if problem := text_problem(value, max_length=limit, multiline=self.multiline):
            raise serializers.ValidationError(problem)
        return value


class WholeNumber(serializers.IntegerField):
    """An integer field that takes integers: a JSON number without a fraction, or, in a form
    body (where every value is text), plain ASCII digits. DRF's IntegerField would also take
    ``"1"``, ``1.0`` or ``true`` from JSON, which the README promises to refuse."""

    def __init__(self, *, choices: Iterable[int] | None = None, **kwargs: Any) -> None:
        self.allowed = tuple(choices) if choices is not None else None
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:
        form_body = isinstance(getattr(self.root, "initial_data", None), QueryDict)
        if form_body and isinstance(data, str):
            number = whole_number(data)
        elif isinstance(data, int) and not isinstance(data, bool):
            number = data
        else:
            number = None
        if number is None:
            self.fail("invalid")
        value = int(super().to_internal_value(number))
        if self.allowed is not None and value not in self.allowed:
            raise serializers.ValidationError(f"Give one of: {', '.join(map(str, self.allowed))}.")
        return value


def choices_message(choices: Iterable[Any]) -> dict[str, Any]:
    """A ChoiceField message listing the choices instead of echoing the (maybe huge) input."""
    return {"invalid_choice": f"Give one of: {', '.join(map(str, choices))}."}


class StrictJSONParser(parsers.JSONParser):
    """JSON bodies without duplicate keys (json.loads keeps the last one silently), lone
    surrogates or deep nesting (see ``_checked_json``)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        encoding = (parser_context or {}).get("encoding", "utf-8")
        try:
            text = stream.read().decode(encoding) if stream is not None else ""
            data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"JSON parse error - {_printable(str(exc))}") from exc
        except RecursionError:  # thousands of nested brackets: Python's parser gives up
            raise exceptions.ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep.") from None
        _checked_json(data)
        return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class ApiView:
    """Mixin for every API view. Scopes (TokenScopes) and rate limits come from
    REST_FRAMEWORK's defaults, so a view that forgets this mixin is still covered.

    ``filters`` names the query parameters of the list (or the plain view's GET); any other
    parameter is refused, as is a repeated or malformed one."""

    kwargs: dict[str, Any]
    filters: tuple[str, ...] = ()
    # Query parameters of other actions, by action name (e.g. {"output": ("offset", "limit")}).
    action_parameters: dict[str, tuple[str, ...]] = {}

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        action = getattr(self, "action", None)
        allowed = {"format"}  # DRF's format override (?format=json)
        if action == "list":
            allowed |= {"cursor", "page_size", *self.filters}
        elif action is None:  # a plain APIView: its GET takes the filters
            allowed |= set(self.filters)
        allowed |= set(self.action_parameters.get(action or "", ()))
        check_query(request.query_params, allowed)

    def get_object(self) -> Any:
        # An id PostgreSQL cannot hold (or not a number) is simply not found, not a 500.
        if whole_number(str(self.kwargs.get("pk", "0"))) is None:
            raise exceptions.NotFound()
        return super().get_object()  # type: ignore[misc]


FILTERS = ("project", "user", "tier", "start", "end")
FILTER_PARAMETERS = [
    OpenApiParameter("project", OpenApiTypes.STR, description="Project slug."),
    OpenApiParameter("user", OpenApiTypes.STR, description="Username."),
    OpenApiParameter("tier", OpenApiTypes.STR, description="Tier slug."),
    OpenApiParameter(
        "start",
        OpenApiTypes.DATETIME,
        description="Period start (ISO 8601, inclusive; a date means its midnight UTC).",
        examples=[OpenApiExample("month", value="2026-11-01T00:00:00Z")],
    ),
    OpenApiParameter("end", OpenApiTypes.DATETIME, description="Period end (ISO 8601, exclusive)."),
]


def moment(name: str, raw: str) -> datetime:
    """An aware UTC datetime, or a 400 naming the parameter."""
    try:
        value = parse_datetime(raw)
        if value is None and (day := parse_date(raw)) is not None:
            value = datetime(day.year, day.month, day.day, tzinfo=UTC)
        if value is not None:
            # In UTC: PostgreSQL refuses offsets it does not know (e.g. -17:14).
            value = value.replace(tzinfo=UTC) if timezone.is_naive(value) else value.astimezone(UTC)
    except (ValueError, OverflowError):
        value = None
    if value is None:
        raise exceptions.ValidationError({name: [f"Not an ISO 8601 date or time: {raw[:40]!r}."]})
    return value


def filter_by(
    params: Any, qs: QuerySet[Any], *, user_field: str, time_field: str, tier: bool = True
) -> QuerySet[Any]:
    """Apply ?project=&user=&tier=&start=&end=; an unknown slug simply matches nothing."""
    for name in ("project", "user", "tier", "start", "end"):
        if "\x00" in params.get(name, ""):  # PostgreSQL refuses NUL in text
            raise exceptions.ValidationError({name: ["Null characters are not allowed."]})
    if project := params.get("project"):
        qs = qs.filter(project__slug=project)
    if user := params.get("user"):
        qs = qs.filter(**{f"{user_field}__username": user})
    if tier and (slug := params.get("tier")):
        qs = qs.filter(tier__slug=slug)
    start = moment("start", params["start"]) if params.get("start") else None
    end = moment("end", params["end"]) if params.get("end") else None
    if start and end and end <= start:
        raise exceptions.ValidationError({"end": ["The end must come after the start."]})
    if start:
        qs = qs.filter(**{f"{time_field}__gte": start})
    if end:
        qs = qs.filter(**{f"{time_field}__lt": end})
    return qs


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
