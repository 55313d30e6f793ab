"""The commands: each takes the parsed arguments and a ``Context`` and returns the JSON
document ``--json`` prints; without ``--json`` it has printed its answer for a person
(the answer on stdout, progress on stderr) and its return value is dropped."""

from __future__ import annotations

import argparse
import getpass
import os
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from gpushare_client import config
from gpushare_client.api import Api
from gpushare_client.exits import ClientError, Exit
from gpushare_client.render import (
    emit_json,
    fields,
    hours,
    money,
    preview_lines,
    say,
    table,
    when,
)
from gpushare_client.routes import (
    ATTEMPTS,
    EVENTS,
    EXTEND,
    INVOICE,
    INVOICES,
    OUTPUT,
    PREVIEW,
    PROJECTS,
    REQUEST,
    REQUEST_FIELDS,
    SANDBOX,
    SANDBOXES,
    STOP,
    USAGE,
)
from gpushare_client.shell import open_shell
from gpushare_client.waiting import ENDED, wait_until_running

FOLLOW_EVERY_S = 2.0
FOLLOW_SETTLE_S = 6.0  # after the end, how long --follow waits for the host's last output


@dataclass
class Context:
    json: bool
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    stdin: TextIO = field(default_factory=lambda: sys.stdin)
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    exit_code: int = 0  # a command's own status (the shell's), when it is not 0
    _api: Api | None = None

    def api(self) -> Api:
        if self._api is None:
            self._api = Api(config.load(self.env))
        return self._api

    def close(self) -> None:
        if self._api is not None:
            self._api.close()

    def say(self, message: str) -> None:
        say(message, self.stderr)

    def show(self, text: str) -> None:
        """The answer, for a person: only without --json (stdout then holds JSON alone)."""
        if not self.json:
            self.stdout.write(text + "\n")
            self.stdout.flush()


# --- signing in ------------------------------------------------------------------------------


def _token(args: argparse.Namespace, ctx: Context, url: str) -> str:
    if args.token_stdin:
        token = ctx.stdin.readline().strip()
    elif ctx.env.get(config.TOKEN_ENV):
        token = ctx.env[config.TOKEN_ENV].strip()
    elif ctx.stdin.isatty():
        token = getpass.getpass(f"API token (make one at {url}/account/tokens/): ", stream=ctx.stderr).strip()
    else:
        raise ClientError(
            Exit.USAGE, f"No token: send it on stdin with --token-stdin, or set {config.TOKEN_ENV}."
        )
    if not token:
        raise ClientError(Exit.USAGE, "The token is empty.")
    return token


def login(args: argparse.Namespace, ctx: Context) -> Any:
    raw = args.url or ctx.env.get(config.URL_ENV)
    if not raw:
        raise ClientError(
            Exit.USAGE, f"Give the portal's address: gpushare login URL (or set {config.URL_ENV})."
        )
    url = config.portal_url(raw)
    if config.is_plain_http_to_another_host(url):
        ctx.say(f"Warning: {url} is plain HTTP: the token can be read on the way. Use https://.")
    credentials = config.Credentials(url, _token(args, ctx, url))
    with Api(credentials) as api:  # checked before it is saved: a wrong token is never kept
        try:
            projects: list[dict[str, Any]] | None = list(api.pages(PROJECTS, limit=1000))
        except ClientError as exc:
            if exc.code != Exit.REFUSED:
                raise
            projects = None  # a token without read:usage: valid, but it may not list projects
            ctx.say(f"The token is valid but cannot read ({exc.message}).")
    path = config.save(credentials, ctx.env)
    ctx.say(f"Signed in to {url}; the token is saved in {path} (readable by you alone).")
    if projects is not None:
        ctx.show(
            "Your projects: "
            + (", ".join(f"{p['slug']} ({p.get('role') or 'admin'})" for p in projects) or "none")
        )
    return {"url": url, "saved_to": str(path), "projects": projects}


def logout(args: argparse.Namespace, ctx: Context) -> Any:
    path = config.config_path(ctx.env)
    removed = config.forget(ctx.env)
    ctx.say(f"Signed out: removed {path}." if removed else f"Not signed in: there was no {path}.")
    if ctx.env.get(config.TOKEN_ENV):
        ctx.say(f"{config.TOKEN_ENV} is still set in this environment: commands will go on using it.")
    ctx.say("The token itself stays valid until it expires: revoke it on the portal's API tokens page.")
    return {"signed_out": removed, "path": str(path)}


# --- sandboxes -------------------------------------------------------------------------------


def _request_body(args: argparse.Namespace) -> dict[str, Any]:
    body = {f.name: getattr(args, f.name) for f in REQUEST_FIELDS if getattr(args, f.name) is not None}
    if body.get("command") and "run" not in body:
        body["run"] = "batch"
    return body


def request(args: argparse.Namespace, ctx: Context) -> Any:
    api = ctx.api()
    body = _request_body(args)
    preview = api.call(PREVIEW, body=body)  # a request the portal would refuse stops here (400)
    for line in preview_lines(preview):
        ctx.say(line)
    if preview.get("verdict") == "refused":
        raise ClientError(Exit.REFUSED, f"Refused: {preview.get('message')}", document={"preview": preview})
    if args.dry_run:
        return {"preview": preview}
    sandbox = api.call(REQUEST, body=body)
    ctx.say(f"Requested sandbox {sandbox['id']}: {sandbox['state']}.")
    if sandbox.get("sharing_terms"):  # the portal's words for what its sharing mode gives
        ctx.say(f"Sharing: {sandbox['sharing_terms']}")
    if args.wait:
        try:
            sandbox = wait_until_running(api, sandbox, timeout_s=args.timeout, say=ctx.say)
        except ClientError as exc:
            exc.document = {"preview": preview, **exc.document}
            raise
    ctx.show(str(sandbox["id"]))  # alone on stdout: ID=$(gpushare request ...)
    return {"preview": preview, "sandbox": sandbox}


SANDBOX_COLUMNS = ("ID", "NAME", "PROJECT", "TIER", "STATE", "HOST", "REQUESTED")


def list_sandboxes(args: argparse.Namespace, ctx: Context) -> Any:
    params = {"project": args.project, "user": args.user, "tier": args.tier}
    limit = None if args.all else args.limit
    sandboxes = list(ctx.api().pages(SANDBOXES, params=params, limit=limit))
    if not ctx.json:
        rows = [
            (s["id"], s.get("name") or "", s["project"], s["tier"], s["state"], s.get("host") or "",
             when(s["requested_at"]))
            for s in sandboxes
        ]  # fmt: skip
        table(rows, SANDBOX_COLUMNS, ctx.stdout)
    return {"sandboxes": sandboxes}


def _describe(sandbox: dict[str, Any]) -> list[tuple[str, Any]]:
    shape = {
        "dedicated": f"{sandbox.get('gpu_count')} GPU(s)",
        "mig": f"MIG {sandbox.get('mig_profile')}",
        "mps": f"MPS {(sandbox.get('mps_memory_mib') or 0) // 1024} GiB, "
        f"{sandbox.get('mps_thread_pct')}% threads",
        "timeslice": "1 time-slice replica",
        "cpu": "CPU only",
    }.get(str(sandbox.get("sharing_mode")), "")
    return [
        ("id", sandbox["id"]), ("name", sandbox.get("name")), ("state", sandbox["state"]),
        ("waits", sandbox.get("pending_reason") if sandbox["state"] == "queued" else ""),
        ("progress", sandbox.get("launch_progress")), ("failure", sandbox.get("failure")),
        ("project", sandbox["project"]), ("owner", sandbox["owner"]), ("tier", sandbox["tier"]),
        ("asks for", shape), ("sharing", sandbox.get("sharing_terms")),
        ("image", sandbox.get("image")), ("isolation", sandbox["isolation"]),
        ("host", sandbox.get("host")), ("kind", "batch" if sandbox.get("batch") else "interactive"),
        ("command", shlex.join(sandbox.get("command") or [])),
        ("time limit", hours(sandbox.get("max_duration_hours"))),
        ("requested", when(sandbox.get("requested_at"))), ("started", when(sandbox.get("started_at"))),
        ("ended", when(sandbox.get("ended_at"))),
    ]  # fmt: skip


def show(args: argparse.Namespace, ctx: Context) -> Any:
    sandbox = ctx.api().call(SANDBOX, id=args.sandbox)
    if not ctx.json:
        fields(_describe(sandbox), ctx.stdout)
    return sandbox


def _event_line(event: dict[str, Any]) -> str:
    moved = f"{event['from_state']} -> {event['to_state']}" if event.get("from_state") else event["to_state"]
    if event.get("from_state") == event["to_state"]:
        moved = event["to_state"]
    by = f" (by {event['actor']})" if event.get("actor") else ""
    return f"{when(event['at'])}  {moved:<22} {event.get('message') or ''}{by}".rstrip()


def _earlier_attempts(api: Api, sandbox: dict[str, Any], ctx: Context, tail: int) -> list[dict[str, Any]]:
    """A sandbox that ran more than once (queued again, moved): each attempt and why it ended,
    and for a batch run the output of each earlier one (the current one's follows)."""
    if int(sandbox.get("attempt") or 0) < 2:
        return []
    attempts: list[dict[str, Any]] = api.call(ATTEMPTS, id=sandbox["id"])
    for attempt in attempts:
        span = (
            f"{when(attempt['placed_at'])} to {when(attempt['ended_at'])}"
            if attempt["ended_at"]
            else (f"since {when(attempt['placed_at'])}")
        )
        why = f": {attempt['end']} ({attempt['end_message']})" if attempt["end"] else ""
        ctx.show(f"attempt {attempt['number']} on {attempt['host']}, {span}{why}")
        if not sandbox.get("batch") or attempt["current"]:
            continue
        piece = api.call(OUTPUT, id=sandbox["id"], params={"limit": tail, "attempt": attempt["number"]})
        attempt["output"] = piece
        if piece["text"] and not ctx.json:
            ctx.show(f"--- output of attempt {attempt['number']} (bytes {piece['start']} to {piece['end']} "
                     f"of {piece['total']}) ---")  # fmt: skip
            ctx.stdout.write(piece["text"] if piece["text"].endswith("\n") else piece["text"] + "\n")
    return attempts


def logs(args: argparse.Namespace, ctx: Context) -> Any:
    """The sandbox's history, then a batch run's output; --follow polls for more until it
    has ended and its host has sent the last of its output. That comes when the host cleans
    up, after the end is recorded (the API's ``complete`` already says true then): so
    following stops once nothing new came for FOLLOW_SETTLE_S after the end."""
    api = ctx.api()
    sandbox = api.call(SANDBOX, id=args.sandbox)
    seen: set[int] = set()
    events: list[dict[str, Any]] = []
    output: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] | None = None  # read once, after the first events
    text: list[str] = []
    quiet_since = time.monotonic()
    while True:
        for event in api.pages(EVENTS, id=args.sandbox):
            if event["id"] not in seen:
                seen.add(event["id"])
                events.append(event)
                ctx.show(_event_line(event))
        if attempts is None:
            attempts = _earlier_attempts(api, sandbox, ctx, args.tail)
        if sandbox.get("batch"):
            params = {"limit": args.tail} if output is None else {"offset": output["end"]}
            piece = api.call(OUTPUT, id=args.sandbox, params=params)
            if piece["text"] and not ctx.json:
                if not text:
                    which = f" of attempt {sandbox['attempt']}" if attempts else ""
                    span = f"bytes {piece['start']} to {piece['end']} of {piece['total']}"
                    ctx.show(f"--- output{which} ({span}) ---")
                ctx.stdout.write(piece["text"])
                ctx.stdout.flush()
            if piece["text"] or sandbox["state"] not in ENDED:
                quiet_since = time.monotonic()
            if piece["text"]:
                text.append(piece["text"])
            start = output["start"] if output and text else piece["start"]
            output = {**piece, "start": start, "text": "".join(text)}
        ended = sandbox["state"] in ENDED and (output is None or output["complete"])
        if not args.follow or (
            ended and (output is None or time.monotonic() - quiet_since >= FOLLOW_SETTLE_S)
        ):
            break
        time.sleep(FOLLOW_EVERY_S)
        sandbox = api.call(SANDBOX, id=args.sandbox)
    return {"sandbox": sandbox, "events": events, "attempts": attempts or [], "output": output}


def shell(args: argparse.Namespace, ctx: Context) -> Any:
    api = ctx.api()
    try:  # a clear "no such sandbox" (404) before the socket, which cannot tell it apart
        sandbox = api.call(SANDBOX, id=args.sandbox)
    except ClientError as exc:
        if exc.code != Exit.REFUSED:  # REFUSED: a token without read:usage may still type
            raise
    else:
        if sandbox["state"] != "running":
            raise ClientError(Exit.REFUSED, f"Sandbox {args.sandbox} is {sandbox['state']}, not running.")
    interactive = args.command is None and sys.stdin.isatty()
    if ctx.json and interactive:
        raise ClientError(Exit.USAGE, "--json takes -c COMMAND or a script on stdin, not a terminal.")
    result = open_shell(config.load(ctx.env), args.sandbox, command=args.command, capture=ctx.json)
    ctx.exit_code = result.status or 0
    if interactive:
        ctx.say(f"\r\nConnection to sandbox {args.sandbox} closed: {result.reason or 'done'}.")
    return {
        "sandbox": args.sandbox,
        "output": result.output.decode("utf-8", "replace"),
        "exit_status": result.status,
        "closed": result.reason,
    }


def extend(args: argparse.Namespace, ctx: Context) -> Any:
    sandbox = ctx.api().call(EXTEND, id=args.sandbox, body={"hours": args.hours})
    ctx.say(f"Sandbox {sandbox['id']}: its time limit is now {hours(sandbox['max_duration_hours'])}.")
    ctx.show(str(sandbox["id"]))
    return sandbox


def stop(args: argparse.Namespace, ctx: Context) -> Any:
    sandbox = ctx.api().call(STOP, id=args.sandbox, body={})
    ctx.say(f"Sandbox {sandbox['id']}: {sandbox['state']}.")
    ctx.show(str(sandbox["id"]))
    return sandbox


# --- money -----------------------------------------------------------------------------------


def _hours_of(seconds: Any) -> str:
    return f"{float(seconds or 0) / 3600:.2f}"


USAGE_COLUMNS = ("SANDBOX", "PROJECT", "USER", "TIER", "GPU", "SHARE", "STARTED", "ENDED", "HOURS", "COST")


def usage(args: argparse.Namespace, ctx: Context) -> Any:
    params = {
        "project": args.project,
        "user": args.user,
        "tier": args.tier,
        "start": args.start,
        "end": args.end,
    }
    records = list(ctx.api().pages(USAGE, params=params, limit=None if args.all else args.limit))
    totals: dict[str, int] = {}
    for record in records:
        if record.get("cost_micros") is not None:
            totals[record["currency"]] = totals.get(record["currency"], 0) + int(record["cost_micros"])
    if not ctx.json:
        rows = [
            (r["sandbox"], r["project"], r["user"], r["tier"], r.get("gpu_model") or "",
             f"{r['milli_gpu'] / 1000:g}", when(r["started_at"]), when(r.get("ended_at")) or "running",
             _hours_of(r.get("duration_seconds")), money(r.get("cost_micros"), r["currency"]))
            for r in records
        ]  # fmt: skip
        table(rows, USAGE_COLUMNS, ctx.stdout)
        for currency, micros in sorted(totals.items()):
            ctx.show(f"Total of the closed intervals listed: {money(micros, currency)}")
    return {"records": records, "total_micros": totals}


def _show_invoice(ctx: Context, invoice: dict[str, Any]) -> None:
    currency = invoice["currency"]
    fields(
        [
            ("invoice", invoice["number"] or f"draft {invoice['id']}"),
            ("project", invoice["project"]),
            ("month", str(invoice["period_start"])[:7]),
            ("state", invoice["state"]),
            ("total", money(invoice["total_micros"], currency)),
            ("finalized", when(invoice.get("finalized_at"))),
        ],
        ctx.stdout,
    )
    lines = [
        (line["sandbox_id"], line["tier"], line.get("gpu_model") or "", when(line["started_at"]),
         when(line["ended_at"]), _hours_of(line["seconds"]), money(line["cost_micros"], currency))
        for line in invoice.get("lines", [])
    ]  # fmt: skip
    table(lines, ("SANDBOX", "TIER", "GPU", "STARTED", "ENDED", "HOURS", "COST"), ctx.stdout)
    for note in invoice.get("credit_notes", []):
        amount = money(note["amount_micros"], currency)
        ctx.show(f"Credit note {note['number']}: {amount} ({note['reason']})")


def invoices(args: argparse.Namespace, ctx: Context) -> Any:
    api = ctx.api()
    if args.invoice is not None:
        invoice = api.call(INVOICE, id=args.invoice)
        if not ctx.json:
            _show_invoice(ctx, invoice)
        return invoice
    params = {"project": args.project, "period": args.period, "state": args.state}
    found = list(api.pages(INVOICES, params=params, limit=None if args.all else args.limit))
    if not ctx.json:
        rows = [
            (i["id"], i["number"] or "(draft)", i["project"], str(i["period_start"])[:7], i["state"],
             money(i["total_micros"], i["currency"]))
            for i in found
        ]  # fmt: skip
        table(rows, ("ID", "NUMBER", "PROJECT", "MONTH", "STATE", "TOTAL"), ctx.stdout)
    return {"invoices": found}


def print_document(ctx: Context, document: Any) -> None:
    if ctx.json:
        emit_json(document, ctx.stdout)
