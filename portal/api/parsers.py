"""The strict JSON parser every API route reads bodies with (REST_FRAMEWORK's default)."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from rest_framework import exceptions, parsers

from portal.api.text import printable

MAX_JSON_DEPTH = 32  # request bodies are flat objects; deeper nesting is a probe


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise exceptions.ValidationError({printable(key): ["Given more than once; give it once."]})
        seen[key] = value
    return seen


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
                field = printable(key) if depth == 0 else where
                stack += [(key, where, depth + 1), (item, field, depth + 1)]
        elif isinstance(value, list):
            stack += [(item, where, depth + 1) for item in value]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class StrictJSONParser(parsers.JSONParser):
    """JSON bodies without duplicate keys (json.loads keeps the last one silently), lone
    surrogates or deep nesting (see ``_checked_json``)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        encoding = (parser_context or {}).get("encoding", "utf-8")
        try:
            text = stream.read().decode(encoding) if stream is not None else ""
            data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"JSON parse error - {printable(str(exc))}") from exc
        except RecursionError:  # thousands of nested brackets: Python's parser gives up
            raise exceptions.ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep.") from None
        _checked_json(data)
        return data
