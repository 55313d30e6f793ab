"""``gpushare``: the arguments of each command, and the one place where a run ends: its
answer printed, and its exit code chosen (``exits.Exit``)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TextIO

from gpushare_client import __version__, commands, ssh
from gpushare_client.exits import EXIT_HELP, ClientError, Exit
from gpushare_client.render import emit_json, say
from gpushare_client.routes import REQUEST_FIELDS

DESCRIPTION = """\
gpushare's command-line client: request GPU sandboxes, watch them start, open their shells,
read their history, output, usage and invoices. Sign in once with an API token made on the
portal's "API tokens" page (scopes read:usage and write:sandboxes):

  gpushare login https://gpushare.example.org
  gpushare request --project vision --tier dedicated --image busybox --gpus 1 --wait
  gpushare shell 42 -c 'nvidia-smi'
  gpushare ssh-config --write && ssh gpushare-42   (scp, rsync, ssh -L, VS Code too)

Every command takes --json: one JSON document on stdout (progress on stderr)."""

ENVIRONMENT = """\
environment:
  GPUSHARE_URL, GPUSHARE_TOKEN  the portal and token to use, over what login saved
  XDG_CONFIG_HOME               where login saves them (gpushare/credentials.json, mode 0600)
  GPUSHARE_DEBUG=1              show the traceback of an unexpected error"""


class UsageError(Exception):
    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.message, self.usage = message, usage


class Parser(argparse.ArgumentParser):
    """argparse, whose errors come back to ``main`` (which prints them, as JSON too)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage())


def object_id(raw: str) -> int:
    if not raw.isascii() or not raw.isdigit() or not 0 < int(raw) < 2**63:
        raise argparse.ArgumentTypeError(f"an id is a whole number, not {raw!r}")
    return int(raw)


def positive(raw: str) -> int:
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"give a whole number from 1, not {raw!r}")
    return int(raw)


def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 10**7:
        raise argparse.ArgumentTypeError(f"give seconds, more than 0, not {raw!r}")
    return value


def _command(
    subparsers: Any, name: str, handler: Callable[[argparse.Namespace, commands.Context], Any], help_text: str
) -> argparse.ArgumentParser:
    sub: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help_text, description=help_text[:1].upper() + help_text[1:] + ".",
        epilog=EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sub.set_defaults(handler=handler)
    return sub


FILTER_HELP = {
    "project": "project slug",
    "user": "username",
    "tier": "tier slug",
    "start": "from this time (ISO 8601, inclusive)",
    "end": "until this time (ISO 8601, exclusive)",
}


def _list_options(sub: argparse.ArgumentParser, *filters: str) -> None:
    for name in filters:
        sub.add_argument(f"--{name}", help=FILTER_HELP[name])
    sub.add_argument("--limit", type=positive, default=50, help="at most this many (default 50)")
    sub.add_argument("--all", action="store_true", help="all of them, page after page")


def build_parser() -> Parser:
    parser = Parser(
        prog="gpushare", description=DESCRIPTION, epilog=EXIT_HELP + "\n\n" + ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"gpushare {__version__}")
    subparsers = parser.add_subparsers(dest="command_name", metavar="COMMAND", required=True)

    sub = _command(subparsers, "login", commands.login, "check an API token against the portal and save it")
    sub.add_argument("url", nargs="?", help="the portal's address, e.g. https://gpushare.example.org")
    sub.add_argument("--token-stdin", action="store_true", help="read the token from stdin (not asked for)")
    _command(subparsers, "logout", commands.logout, "forget the saved token")

    sub = _command(
        subparsers, "request", commands.request, "request a sandbox, seeing first whether it starts now"
    )
    for field in REQUEST_FIELDS:
        sub.add_argument(
            field.option, dest=field.name, type=field.kind, required=field.required, metavar=field.metavar,
            help=field.help,
        )  # fmt: skip
    sub.add_argument(
        "--wait", action="store_true", help="follow it until it runs (exit 6 if it ends instead)"
    )
    sub.add_argument("--timeout", type=seconds, help="with --wait: give up after this many seconds (exit 7)")
    sub.add_argument(
        "--dry-run", action="store_true", help="only say whether it would start now; request nothing"
    )

    sub = _command(subparsers, "list", commands.list_sandboxes, "list sandboxes, newest request first")
    _list_options(sub, "project", "user", "tier")
    sub = _command(subparsers, "show", commands.show, "show one sandbox")
    sub.add_argument("sandbox", type=object_id)
    sub = _command(subparsers, "logs", commands.logs, "a sandbox's history and, for a batch run, its output")
    sub.add_argument("sandbox", type=object_id)
    sub.add_argument("--follow", "-f", action="store_true", help="go on printing until the sandbox ends")
    sub.add_argument("--tail", type=positive, default=256 * 1024, help="output: the last this many bytes")
    sub = _command(subparsers, "shell", commands.shell, "a shell in a running sandbox (or run one command)")
    sub.add_argument("sandbox", type=object_id)
    sub.add_argument(
        "-c",
        dest="command",
        metavar="COMMAND",
        help="run this command, print its output, exit with its status",
    )
    sub = _command(
        subparsers, "ssh-config", ssh.ssh_config, "an OpenSSH entry that reaches sandboxes as gpushare-ID"
    )
    sub.add_argument(
        "--write",
        action="store_true",
        help="write it, include it from ~/.ssh/config, and make and add a key if needed (else print it)",
    )
    sub.add_argument("--identity", metavar="PATH", help="log in with this private key (its .pub is added)")
    sub = _command(
        subparsers, "ssh-proxy", ssh.ssh_proxy, "relay stdin and stdout to a sandbox's sshd (a ProxyCommand)"
    )
    sub.add_argument("target", metavar="SANDBOX", help="gpushare-ID or ID")
    sub = _command(subparsers, "extend", commands.extend, "add hours to a sandbox's time limit")
    sub.add_argument("sandbox", type=object_id)
    sub.add_argument("--hours", type=positive, required=True, help="hours to add: 1, 2, 4 or 8")
    sub = _command(subparsers, "stop", commands.stop, "stop a sandbox (a queued one is withdrawn)")
    sub.add_argument("sandbox", type=object_id)

    sub = _command(subparsers, "usage", commands.usage, "usage intervals and their cost, newest first")
    _list_options(sub, "project", "user", "tier", "start", "end")
    sub = _command(subparsers, "invoices", commands.invoices, "invoices, or one invoice with its lines")
    sub.add_argument("invoice", nargs="?", type=object_id, help="an invoice id: show it whole")
    sub.add_argument("--project", help="project slug")
    sub.add_argument("--period", metavar="YYYY-MM", help="the billed month")
    sub.add_argument("--state", help="draft or finalized")
    sub.add_argument("--limit", type=positive, default=50, help="at most this many (default 50)")
    sub.add_argument("--all", action="store_true", help="all of them, page after page")
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run one command; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    err = stderr or sys.stderr
    ctx = commands.Context(
        json="--json" in argv, env=os.environ if env is None else env, stdin=stdin or sys.stdin,
        stdout=stdout or sys.stdout, stderr=err,
    )  # fmt: skip
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        err.write(exc.usage)
        say(f"gpushare: {exc.message}", err)
        if ctx.json:
            emit_json(ClientError(Exit.USAGE, exc.message).as_json(), ctx.stdout)
        return int(Exit.USAGE)
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0) if isinstance(exc.code, int) else 0
    try:
        document = args.handler(args, ctx)
        commands.print_document(ctx, document)
        return ctx.exit_code
    except ClientError as exc:
        say(f"gpushare: {exc.message}", err)
        if ctx.json:
            emit_json(exc.as_json(), ctx.stdout)
        return int(exc.code)
    except KeyboardInterrupt:
        say("gpushare: interrupted.", err)
        return int(Exit.INTERRUPTED)
    except Exception as exc:
        if ctx.env.get("GPUSHARE_DEBUG"):
            traceback.print_exc(file=err)
        say(f"gpushare: unexpected error: {type(exc).__name__}: {exc} (GPUSHARE_DEBUG=1 shows where).", err)
        if ctx.json:
            emit_json(ClientError(Exit.ERROR, f"{type(exc).__name__}: {exc}").as_json(), ctx.stdout)
        return int(Exit.ERROR)
    finally:
        ctx.close()


def run() -> None:
    """The console script's entry point."""
    sys.exit(main())
