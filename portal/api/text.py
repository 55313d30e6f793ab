"""Checks of the text a caller sends: query parameters, body fields and their names.

Shared by the API and by the HTML forms that take the same input (the sandbox request
form, the token form), so that both refuse the same things the same way."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from rest_framework import exceptions

# Query values are slugs, usernames, ISO times and cursors: far shorter than this. A longer
# one is a mistake or a probe, and is refused rather than sent to the database.
MAX_PARAM_LENGTH = 255
MAX_CURSOR_LENGTH = 1000


def printable(text: str) -> str:
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
        shown = printable(name)
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
        printable(str(name)): [f"Unknown field; this request takes {known}."]
        for name in data
        if name not in allowed
    }


def repeated_fields(data: Any) -> dict[str, list[str]]:
    """A form body's fields given more than once (a JSON body cannot repeat: StrictJSONParser)."""
    if not hasattr(data, "lists"):
        return {}
    return {printable(k): ["Given more than once; give it once."] for k, v in data.lists() if len(v) > 1}


def refuse_unexpected_fields(data: Any, allowed: Iterable[str]) -> None:
    """A 400 naming every field the route does not take or that is given twice."""
    if problems := {**repeated_fields(data), **unknown_fields(data, allowed)}:
        raise exceptions.ValidationError(problems)
