"""``gpushare shell``: piped scripts, one command, an interactive terminal with its size, and
the terminal's refusals, against a real ``/bin/sh`` on a pty behind the portal's protocol
(tests/cli/fake_terminal.py); and the filter that keeps only what the commands print."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import termios
import threading
import time
from typing import Any, BinaryIO

import pytest
from gpushare_client.config import Credentials
from gpushare_client.exits import ClientError, Exit
from gpushare_client.shell import READY, OutputFilter, command_line, end_of_script, open_shell, socket_url

from tests.cli.conftest import Run
from tests.cli.fake_portal import TOKEN, sandbox
from tests.cli.fake_terminal import FakeTerminal, header, terminal_server


def piped(text: bytes) -> BinaryIO:
    """A pipe holding ``text`` then its end, as ``printf ... | gpushare shell`` gives stdin."""
    read, write = os.pipe()
    os.write(write, text)
    os.close(write)
    return os.fdopen(read, "rb")


def shell(url: str, stdin: BinaryIO, token: str = TOKEN, **kwargs: Any) -> tuple[Any, bytes]:
    out = io.BytesIO()
    result = open_shell(Credentials(url, token), 7, stdin=stdin, stdout=out, **kwargs)
    return result, out.getvalue()


# --- the output filter ------------------------------------------------------------------------


def test_the_filter_drops_the_set_up_and_keeps_the_commands_output() -> None:
    f = OutputFilter(wait_for_ready=True)
    echoed = b"stty -echo -onlcr 2>/dev/null; PS1=''; printf '\\036gpushare:ready\\036\\n'\r\n$ "
    assert f.feed(echoed) == b"" and not f.ready
    assert f.feed(READY[:5]) == b""  # a marker split across pieces
    assert f.feed(READY[5:] + b"\nhi\n") == b"hi\n" and f.ready
    assert f.feed(b"two\n\x1egpushare:ex") == b"two\n"
    assert f.feed(b"it=3") == b"" and f.status is None
    assert f.feed(b"\x1e\nbye") == b"bye" and f.status == 3
    assert f.feed(b"a \x1e b") == b"a \x1e b"  # a lone separator that is not a marker passes
    assert f.flush() == b""


def test_the_filter_passes_everything_when_nothing_is_set_up() -> None:
    f = OutputFilter(wait_for_ready=False)
    assert f.feed(b"\x1b[1m$ \x1b[0m") == b"\x1b[1m$ \x1b[0m"
    assert f.feed(b"\x1egpushare:exit=") == b""
    assert f.flush() == b"\x1egpushare:exit="  # the end came first: what was held is passed on


def test_what_is_typed_for_a_command_and_after_a_script() -> None:
    status = "printf '\\036gpushare:exit=%d\\036\\n' \"$?\""
    assert command_line("echo 'hi there'; exit 3") == (
        "sh -c 'echo '\"'\"'hi there'\"'\"'; exit 3' </dev/null; " + status + "; exit\n"
    )
    assert end_of_script(b"\n").startswith("printf ") and end_of_script(b"x").startswith("\nprintf ")
    assert (
        socket_url("https://gpu.example.org/portal", 7)
        == "wss://gpu.example.org/portal/ws/sandboxes/7/terminal/"
    )
    assert socket_url("http://127.0.0.1:8000", 12) == "ws://127.0.0.1:8000/ws/sandboxes/12/terminal/"


# --- against a real shell -------------------------------------------------------------------------


def test_a_piped_script_prints_only_what_it_prints() -> None:
    terminal = FakeTerminal()
    with terminal_server(terminal) as url:
        result, out = shell(url, piped(b"echo hi\nexit\n"))
    assert out == b"hi\n" and result.status is None and result.reason == "shell exited"
    assert header(terminal, "Authorization") == f"Bearer {TOKEN}" and header(terminal, "Origin") is None


def test_a_script_that_does_not_exit_ends_with_its_last_status() -> None:
    with terminal_server(FakeTerminal()) as url:
        result, out = shell(url, piped(b"echo one\nprintf 'two\\n'\nfalse"))  # no last newline
    assert out == b"one\ntwo\n" and result.status == 1


def test_one_command_gives_its_output_and_its_status() -> None:
    with terminal_server(FakeTerminal()) as url:
        result, out = shell(url, piped(b"ignored\n"), command="echo hi; cat; exit 3")
    assert out == b"hi\n" and result.status == 3  # cat reads nothing: no input for a command


@pytest.mark.parametrize(
    ("refuse", "code", "says"),
    [
        ((4409, "The sandbox is queued, not running."), Exit.REFUSED, "The sandbox is queued, not running."),
        ((4403, "Only the sandbox's owner, ..."), Exit.REFUSED, "Only the sandbox's owner"),
        ((4429, "Too many invalid API tokens from here"), Exit.RATE_LIMITED, "Too many invalid API tokens"),
    ],
)
def test_a_refused_terminal_says_why(refuse: tuple[int, str], code: Exit, says: str) -> None:
    with terminal_server(FakeTerminal(refuse=refuse)) as url, pytest.raises(ClientError) as refused:
        shell(url, piped(b"echo hi\n"))
    assert refused.value.code == code and says in refused.value.message


def test_a_wrong_token_is_an_auth_failure() -> None:
    with terminal_server(FakeTerminal()) as url, pytest.raises(ClientError) as refused:
        shell(url, piped(b"echo hi\n"), token="gps_wrong")
    assert refused.value.code == Exit.AUTH and "Invalid or revoked API token." in refused.value.message


def test_no_portal_there_is_unreachable() -> None:
    with terminal_server(FakeTerminal()) as url:
        pass  # shut down again
    with pytest.raises(ClientError) as failed:
        shell(url, piped(b""))
    assert failed.value.code == Exit.UNREACHABLE


def test_an_interactive_terminal_is_raw_sends_its_size_and_is_restored() -> None:
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    keyboard = os.fdopen(side, "rb", buffering=0)
    before = termios.tcgetattr(side)
    terminal = FakeTerminal()
    seen: dict[str, Any] = {}

    def type_keys() -> None:
        time.sleep(0.5)
        os.write(main, b"echo typed-$((6*7))\r")
        time.sleep(0.5)
        seen["raw"] = termios.tcgetattr(side)
        os.write(main, b"exit\r")

    typist = threading.Thread(target=type_keys)
    with terminal_server(terminal) as url:
        typist.start()
        result, out = shell(url, keyboard)
    typist.join()
    assert b"typed-42" in out and result.reason == "shell exited"
    assert terminal.resizes[:1] == [(33, 101)]
    assert not seen["raw"][3] & termios.ECHO and not seen["raw"][3] & termios.ICANON  # raw while open
    assert termios.tcgetattr(side) == before  # and as it was after
    keyboard.close()
    os.close(main)


def test_the_command_checks_the_sandbox_then_prints_json(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    with terminal_server(FakeTerminal()) as url:
        gpushare.env["GPUSHARE_URL"] = url  # the fake portal answers the API, the fake terminal the socket
        result = gpushare("shell", "7", "-c", "echo hi; exit 4", "--json")
    assert result.code == 4, result.err
    assert result.json() == {"sandbox": 7, "output": "hi\n", "exit_status": 4, "closed": "shell exited"}
    gpushare.portal.states = [sandbox(state="queued")]
    queued = gpushare("shell", "7", "-c", "true")
    assert queued.code == Exit.REFUSED and "Sandbox 7 is queued, not running." in queued.err
    assert gpushare("shell", "8", "-c", "true").code == Exit.NOT_FOUND


def test_json_needs_a_command_or_a_script_not_a_terminal(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Keyboard(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Keyboard())
    result = gpushare("shell", "7", "--json")
    assert result.code == Exit.USAGE and result.json()["error"]["message"].startswith(
        "--json takes -c COMMAND"
    )
