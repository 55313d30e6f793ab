"""What the client prints. The answer goes to stdout (a table, or one JSON document with
``--json``); progress, verdicts and messages for a person go to stderr, so that
``gpushare list --json | jq`` reads only JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO


def say(message: str, stream: TextIO | None = None) -> None:
    """A line for the person at the terminal (stderr)."""
    out = stream or sys.stderr
    out.write(message + "\n")
    out.flush()


def emit_json(document: Any, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    out.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    out.flush()


def when(value: Any) -> str:
    """An API timestamp (ISO 8601) as ``2026-11-01 10:00:05``; empty for none."""
    if not value:
        return ""
    text = str(value).replace("T", " ")
    return text[:19]


def money(micros: Any, currency: str) -> str:
    if micros is None:
        return ""
    return f"{int(micros) / 1_000_000:,.2f} {currency}"


def hours(value: Any) -> str:
    if value is None:
        return ""
    number = float(value)
    return f"{number:g} h"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], stream: TextIO | None = None) -> None:
    """Columns as wide as their widest cell; the last one unpadded."""
    out = stream or sys.stdout
    cells = [[str(c) for c in header], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        out.write("  ".join(padded).rstrip() + "\n")
    out.flush()


def fields(pairs: Sequence[tuple[str, Any]], stream: TextIO | None = None) -> None:
    """``name: value`` lines, names aligned; empty values left out."""
    out = stream or sys.stdout
    shown = [(name, value) for name, value in pairs if value not in (None, "", [])]
    width = max((len(name) for name, _ in shown), default=0)
    for name, value in shown:
        out.write(f"{name + ':':<{width + 1}} {value}\n")
    out.flush()


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def preview_lines(preview: dict[str, Any]) -> list[str]:
    """The request form's live answer, as the portal's page words it, then the answer with
    each GPU model the tier offers."""
    return _verdict_lines(preview) + [
        f"With {answer.get('model')}: {_model_answer(answer)}" for answer in preview.get("by_model") or []
    ]


def _model_answer(answer: dict[str, Any]) -> str:
    verdict, message = answer.get("verdict"), str(answer.get("message", ""))
    if verdict == "now":
        return message
    if verdict == "waits":
        return f"waits, {ordinal(int(answer.get('position') or 1))} in line"
    return f"refused: {message}"


def _verdict_lines(preview: dict[str, Any]) -> list[str]:
    verdict, message = preview.get("verdict"), str(preview.get("message", ""))
    if verdict == "now":
        return [f"Would start: {message}."]
    if verdict == "waits":
        lines = [f"Would wait: {ordinal(int(preview.get('position') or 1))} in line.", f"Why: {message}."]
        eta = preview.get("earliest_start")
        lines.append(
            f"Earliest start: {when(eta)} UTC, when running sandboxes reach their time limit."
            if eta
            else "No start time can be promised: what it needs is held by sandboxes without a known end."
        )
        lines += [f"Could start now instead: {alt}" for alt in preview.get("alternatives") or []]
        return lines
    return [f"Would be refused: {message}"]


def progress_line(sandbox: dict[str, Any]) -> str:
    """One line of a sandbox's progress towards running: its state, why it waits, what its
    host is doing (pulling its image)."""
    state = str(sandbox.get("state", "?"))
    host = sandbox.get("host")
    line = f"sandbox {sandbox.get('id')}: {state}" + (f" on {host}" if host else "")
    if state == "queued" and sandbox.get("pending_reason"):
        line += f" - waits: {sandbox['pending_reason']}"
    if sandbox.get("launch_progress") and state in ("placing", "starting"):
        line += f" - {sandbox['launch_progress']}"
    if sandbox.get("failure"):
        line += f" - {sandbox['failure']}"
    return line
