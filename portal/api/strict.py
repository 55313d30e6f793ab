"""Request body serializers that take exactly what they document: no unknown or repeated
field, text without control characters, integers that are integers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.http import QueryDict
from rest_framework import serializers

from portal.api.text import MAX_PARAM_LENGTH, refuse_unexpected_fields, text_problem
from portal.inputs import whole_number


class StrictSerializer(serializers.Serializer[Any]):
    """A request body serializer that refuses fields it does not have, or has twice."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        refuse_unexpected_fields(data, self.fields)
        return super().to_internal_value(data)


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
