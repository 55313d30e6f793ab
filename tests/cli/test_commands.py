"""``gpushare``'s commands against a stand-in portal (tests/cli/fake_portal.py), in-process
and fast: their arguments, what they print where (the answer on stdout, a person's text on
stderr, JSON alone on stdout with --json), and the exit code that says what happened."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from gpushare_client.exits import Exit

from tests.cli.conftest import Run
from tests.cli.fake_portal import BASE, TOKEN, sandbox

REQUEST = ("request", "--project", "vision", "--tier", "dedicated", "--image", "busybox", "--gpus", "1")
# One run of every command, as a script would call it.
EVERY_COMMAND = [
    ("login", BASE, "--token-stdin"),
    ("logout",),
    REQUEST,
    ("list",),
    ("show", "7"),
    ("logs", "7"),
    ("extend", "7", "--hours", "2"),
    ("stop", "7"),
    ("usage",),
    ("invoices",),
    ("invoices", "3"),
]


def test_help_lists_the_commands_and_the_exit_codes(
    gpushare: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpushare("--help").code == 0
    shown = capsys.readouterr().out
    for name in ("login", "logout", "request", "list", "show", "logs", "shell", "extend", "stop", "usage",
                 "invoices"):  # fmt: skip
        assert f"\n    {name} " in shown, name
    for code in Exit:
        if code != Exit.OK:
            assert f"  {int(code):<4} " in shown, code


@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda argv: " ".join(argv))
def test_every_commands_json_is_one_document_on_stdout(gpushare: Run, argv: tuple[str, ...]) -> None:
    result = gpushare(*argv, "--json", stdin=TOKEN + "\n")
    assert result.code == 0, result.err
    assert isinstance(result.json(), dict)  # stdout held nothing else


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ("request", "--tier", "dedicated", "--image", "busybox"),
            "the following arguments are required: --project",
        ),
        (("request", *REQUEST[1:], "--gpus", "two"), "argument --gpus: invalid int value: 'two'"),
        (("show", "seven"), "an id is a whole number, not 'seven'"),
        (("show", "-1"), "an id is a whole number, not '-1'"),
        (("extend", "7"), "the following arguments are required: --hours"),
        (("request", *REQUEST[1:], "--wait", "--timeout", "soon"), "give seconds, more than 0"),
        (("launch",), "invalid choice: 'launch'"),
        ((), "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_and_say_why_as_json_too(
    gpushare: Run, argv: tuple[str, ...], says: str
) -> None:
    result = gpushare(*argv)
    assert result.code == 2 and says in result.err and "usage: gpushare" in result.err, result.err
    assert result.out == "" and gpushare.portal.seen == []
    as_json = gpushare(*argv, "--json")
    assert as_json.code == 2 and as_json.json()["error"]["kind"] == "usage"


# --- login ---------------------------------------------------------------------------------


def test_login_checks_the_token_then_saves_it_for_its_owner_alone(gpushare: Run) -> None:
    env = {"XDG_CONFIG_HOME": gpushare.env["XDG_CONFIG_HOME"]}  # nothing from the environment
    gpushare.env = env
    result = gpushare("login", BASE + "/", "--token-stdin", stdin=f"  {TOKEN}\n")
    assert result.code == 0, result.err
    assert result.out == "Your projects: vision (manager)\n"
    path = Path(env["XDG_CONFIG_HOME"]) / "gpushare" / "credentials.json"
    assert f"the token is saved in {path}" in result.err
    assert json.loads(path.read_text()) == {"url": BASE, "token": TOKEN}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert gpushare("show", "7").code == 0  # the saved token is used
    assert gpushare.portal.seen[-1][:2] == ("GET", "/api/v1/sandboxes/7/")
    logout = gpushare("logout", "--json")
    assert logout.code == 0 and logout.json() == {"signed_out": True, "path": str(path)}
    assert not path.exists()
    after = gpushare("list")
    assert after.code == Exit.AUTH and "Not signed in: run gpushare login URL" in after.err


def test_a_wrong_token_is_not_saved(gpushare: Run) -> None:
    gpushare.env = {"XDG_CONFIG_HOME": gpushare.env["XDG_CONFIG_HOME"]}
    result = gpushare("login", BASE, "--token-stdin", "--json", stdin="gps_wrong\n")
    assert result.code == Exit.AUTH
    assert result.json()["error"] == {
        "exit": 4, "kind": "auth", "message": "Token refused: Invalid or revoked API token.",
    }  # fmt: skip
    assert not (Path(gpushare.env["XDG_CONFIG_HOME"]) / "gpushare").exists()


def test_login_takes_the_token_from_the_environment_and_never_asks_without_a_terminal(gpushare: Run) -> None:
    assert gpushare("login", BASE).code == 0  # GPUSHARE_TOKEN
    gpushare.env = {"XDG_CONFIG_HOME": gpushare.env["XDG_CONFIG_HOME"]}
    no_token = gpushare("login", BASE)
    assert no_token.code == Exit.USAGE and "send it on stdin with --token-stdin" in no_token.err
    assert gpushare("login", "--token-stdin", stdin=TOKEN).code == Exit.USAGE  # no URL
    for url in ("ftp://portal.test", "portal.test", "http://portal.test/?x=1", "http://h:99999"):
        result = gpushare("login", url, "--token-stdin", stdin=TOKEN)
        assert result.code == Exit.USAGE and ("portal" in result.err or "URL" in result.err), url


def test_login_warns_of_plain_http_beyond_this_machine_and_keeps_a_token_that_cannot_read(
    gpushare: Run,
) -> None:
    gpushare.portal.overrides[("GET", "/api/v1/projects/")] = lambda request: httpx.Response(
        403, json={"detail": "This API token lacks the scope 'read:usage'."}
    )
    result = gpushare("login", BASE, "--token-stdin", "--json", stdin=TOKEN)
    assert result.code == 0 and result.json()["projects"] is None
    assert "plain HTTP: the token can be read on the way" in result.err
    assert "valid but cannot read (Refused: This API token lacks the scope 'read:usage'.)" in result.err


def test_the_environment_overrides_the_saved_token(gpushare: Run) -> None:
    folder = Path(gpushare.env["XDG_CONFIG_HOME"]) / "gpushare"
    folder.mkdir(parents=True)
    (folder / "credentials.json").write_text(json.dumps({"url": "http://elsewhere.test", "token": "gps_old"}))
    assert gpushare("show", "7").code == 0  # GPUSHARE_URL and GPUSHARE_TOKEN win
    (folder / "credentials.json").write_text("{not json")
    gpushare.env.pop("GPUSHARE_TOKEN")
    broken = gpushare("show", "7")
    assert broken.code == Exit.ERROR and "Run gpushare login again" in broken.err


# --- request -------------------------------------------------------------------------------


def test_request_shows_the_live_answer_then_prints_the_id_alone(gpushare: Run) -> None:
    result = gpushare(*REQUEST, "--hours", "2", "--name", "sweep", "--isolation", "container")
    assert result.code == 0, result.err
    assert result.out == "7\n"
    assert "Would start: starts now on h1." in result.err and "Requested sandbox 7: queued." in result.err
    posts = [(path, body) for method, path, body in gpushare.portal.seen if method == "POST"]
    body = {"project": "vision", "tier": "dedicated", "image": "busybox", "gpu_count": 1, "duration_hours": 2,
            "name": "sweep", "isolation": "container"}  # fmt: skip
    assert posts == [("/api/v1/sandboxes/preview/", body), ("/api/v1/sandboxes/", body)]


def test_a_command_makes_a_batch_run_and_every_field_reaches_the_body(gpushare: Run) -> None:
    argv = ("request", "--project", "vision", "--tier", "mig", "--image", "busybox",
            "--mig-profile", "1g.10gb", "--command", "python train.py --epochs 3", "--dry-run")  # fmt: skip
    assert gpushare(*argv).code == 0
    [(_, _, body)] = gpushare.portal.seen  # --dry-run: the preview only
    assert body == {"project": "vision", "tier": "mig", "image": "busybox", "mig_profile": "1g.10gb",
                    "command": "python train.py --epochs 3", "run": "batch"}  # fmt: skip
    mps = ("request", "--project", "p", "--tier", "mps", "--image", "i", "--mps-memory", "10",
           "--mps-threads", "25", "--run", "interactive", "--dry-run")  # fmt: skip
    gpushare(*mps)
    assert gpushare.portal.seen[-1][2] == {"project": "p", "tier": "mps", "image": "i", "mps_memory_gib": 10,
                                           "mps_thread_pct": 25, "run": "interactive"}  # fmt: skip


def test_a_refused_request_exits_3_naming_the_field_and_requests_nothing(gpushare: Run) -> None:
    result = gpushare("request", "--project", "vision", "--tier", "gold", "--image", "busybox")
    assert result.code == Exit.REFUSED and result.out == ""
    assert "gpushare: Refused: tier: No such open tier." in result.err
    as_json = gpushare("request", "--project", "vision", "--tier", "gold", "--image", "busybox", "--json")
    assert as_json.json()["error"] == {
        "exit": 3, "kind": "refused", "message": "Refused: tier: No such open tier.",
        "fields": {"tier": ["No such open tier."]},
    }  # fmt: skip
    assert [path for method, path, _ in gpushare.portal.seen if method == "POST"] == [
        "/api/v1/sandboxes/preview/"
    ] * 2


def test_a_wait_shows_each_step_and_ends_running(gpushare: Run) -> None:
    gpushare.portal.states = [
        sandbox(state="queued", pending_reason="waiting for 1 free GPU on one host"),
        sandbox(
            state="starting", host="h1", launch_progress="pulling lab/x:1: 2 of 5 layers, 10 MiB of 40 MiB"
        ),
        sandbox(
            state="starting", host="h1", launch_progress="pulling lab/x:1: 2 of 5 layers, 10 MiB of 40 MiB"
        ),
        sandbox(state="running", host="h1", started_at="2026-11-28T10:01:00Z"),
    ]
    result = gpushare(*REQUEST, "--wait", "--json")
    assert result.code == 0, result.err
    assert result.json()["sandbox"]["state"] == "running" and result.json()["preview"]["verdict"] == "now"
    progress = [line for line in result.err.splitlines() if line.startswith("sandbox 7:")]
    assert progress == [
        "sandbox 7: queued - waits: waiting for the scheduler",
        "sandbox 7: queued - waits: waiting for 1 free GPU on one host",
        "sandbox 7: starting on h1 - pulling lab/x:1: 2 of 5 layers, 10 MiB of 40 MiB",
        "sandbox 7: running on h1",
    ]


def test_a_preview_that_waits_says_why_and_the_earliest_start(gpushare: Run) -> None:
    gpushare.portal.preview = {
        "verdict": "waits", "message": "waiting for 2 free GPUs on one host", "host": "", "position": 3,
        "earliest_start": "2026-11-28T18:00:00Z", "alternatives": ["1 whole GPU(s) are free now on h1"],
    }  # fmt: skip
    result = gpushare(*REQUEST, "--dry-run")
    assert result.code == 0 and result.out == ""
    assert result.err.splitlines() == [
        "Would wait: 3rd in line.",
        "Why: waiting for 2 free GPUs on one host.",
        "Earliest start: 2026-11-28 18:00:00 UTC, when running sandboxes reach their time limit.",
        "Could start now instead: 1 whole GPU(s) are free now on h1",
    ]


@pytest.mark.parametrize(
    ("final", "code", "says"),
    [
        (sandbox(state="failed", failure="the image could not be pulled"), Exit.SANDBOX_ENDED,
         "Sandbox 7 failed instead of running: the image could not be pulled"),
        (sandbox(state="stopped", pending_reason=""), Exit.SANDBOX_ENDED,
         "Sandbox 7 stopped instead of running"),
        (sandbox(state="queued"), Exit.TIMED_OUT, "Sandbox 7 is still queued after 0.05 s"),
    ],
)  # fmt: skip
def test_a_wait_that_does_not_end_running_says_how_it_ended(
    gpushare: Run, final: dict[str, Any], code: Exit, says: str
) -> None:
    gpushare.portal.states = [sandbox(state="queued"), final]
    result = gpushare(*REQUEST, "--wait", "--timeout", "0.05", "--json")
    assert result.code == code and says in result.err, result.err
    document = result.json()
    assert document["error"]["exit"] == code and document["sandbox"]["state"] == final["state"]
    assert document["preview"]["verdict"] == "now"


def test_a_batch_run_that_already_ended_has_run(gpushare: Run) -> None:
    gpushare.portal.states = [sandbox(state="stopped", batch=True, started_at="2026-11-28T10:00:05Z")]
    assert gpushare(*REQUEST, "--command", "echo hi", "--wait").code == 0


def test_a_wait_rides_out_a_portal_restart(gpushare: Run) -> None:
    calls = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 2:
            return httpx.Response(502, text="<html>Bad Gateway</html>")
        return httpx.Response(200, json=sandbox(state="running", host="h1"))

    gpushare.portal.overrides[("GET", "/api/v1/sandboxes/7/")] = flaky
    result = gpushare(*REQUEST, "--wait")
    assert result.code == 0 and "answered 502" in result.err and "Asking again." in result.err


# --- the other commands ----------------------------------------------------------------------


def test_list_follows_the_pages_up_to_the_limit(gpushare: Run) -> None:
    result = gpushare("list")
    lines = result.out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "PROJECT", "TIER", "STATE", "HOST", "REQUESTED"]
    assert [line.split()[0] for line in lines[1:]] == ["7", "6", "5"]
    assert "2026-11-28 10:00:00" in lines[1]
    assert [s["id"] for s in gpushare("list", "--limit", "2", "--json").json()["sandboxes"]] == [7, 6]


def test_a_page_link_to_another_address_is_not_followed(gpushare: Run) -> None:
    gpushare.portal.overrides[("GET", "/api/v1/sandboxes/")] = lambda request: httpx.Response(
        200, json={"next": "http://evil.test/steal", "previous": None, "results": [sandbox()]}
    )
    result = gpushare("list")
    assert result.code == Exit.UNREACHABLE and "a page link to another address" in result.err
    assert all(path.startswith("/api/") for _, path, _ in gpushare.portal.seen)


def test_show_says_what_a_time_slice_replica_shares_in_the_portals_words(gpushare: Run) -> None:
    gpushare.portal.states = [sandbox(state="running", sharing_mode="timeslice", tier="timeslice")]
    shown = gpushare("show", "7").out
    assert "asks for:   1 time-slice replica" in shown
    [line] = [line for line in shown.splitlines() if line.startswith("sharing:")]
    assert "Shares the whole GPU with up to N-1 others" in line and "no memory or compute reservation" in line
    assert "one replica's crash can end the others' work" in line


def test_show_logs_extend_stop(gpushare: Run) -> None:
    shown = gpushare("show", "7").out
    assert "state:" in shown and "asks for:   1 GPU(s)" in shown and "image:      busybox" in shown
    logs = gpushare("logs", "7").out.splitlines()
    assert logs[0] == "2026-11-28 10:00:00  requested              requested 1 GPU on Dedicated (by olivia)"
    assert logs[2].startswith("2026-11-28 10:00:02  queued -> running")
    gpushare.portal.states = [sandbox(state="stopped", batch=True)]
    batch = gpushare("logs", "7", "--json").json()
    assert batch["output"]["text"] == "hello\n" and [e["id"] for e in batch["events"]] == [1, 2, 3]
    assert gpushare("logs", "7").out.endswith("--- output (bytes 0 to 6 of 6) ---\nhello\n")
    extended = gpushare("extend", "7", "--hours", "2")
    assert extended.out == "7\n" and "its time limit is now 3 h" in extended.err
    refused = gpushare("extend", "7", "--hours", "3")
    assert refused.code == Exit.REFUSED and "hours: Give one of: 1, 2, 4, 8." in refused.err
    stopped = gpushare("stop", "7", "--json")
    assert stopped.json()["state"] == "stopping" and gpushare.portal.seen[-1][2] == {}


def test_logs_follow_a_batch_until_its_last_output_has_come(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host sends a batch's last lines when it cleans up, after the end is recorded."""
    from gpushare_client import commands

    monkeypatch.setattr(commands, "FOLLOW_EVERY_S", 0.01)
    monkeypatch.setattr(commands, "FOLLOW_SETTLE_S", 0.2)
    gpushare.portal.states = [
        sandbox(state="running", batch=True),
        sandbox(state="stopped", batch=True),
    ]
    gpushare.portal.output = ["epoch 1\n", "epoch 1\n", "epoch 1\nepoch 2\n", "epoch 1\nepoch 2\ndone\n"]
    result = gpushare("logs", "7", "--follow", "--json")
    assert result.code == 0 and result.json()["output"]["text"] == "epoch 1\nepoch 2\ndone\n"
    assert result.json()["output"]["start"] == 0 and result.json()["sandbox"]["state"] == "stopped"


def test_logs_show_every_attempt_and_each_ones_output(gpushare: Run) -> None:
    """A batch preempted and queued again: both attempts, why the first ended, its output."""
    gpushare.portal.states = [sandbox(state="running", batch=True, attempt=2)]
    gpushare.portal.output = ["step 3\n"]
    out = gpushare("logs", "7").out
    assert (
        "attempt 1 on h1, 2026-11-28 10:00:02 to 2026-11-28 10:30:00: preempted (preempted for sandbox 9"
        in out
    )
    assert "attempt 2 on h2, since 2026-11-28 11:00:00" in out
    assert out.endswith(  # each attempt, then its output
        "--- output of attempt 1 (bytes 0 to 14 of 14) ---\nstep 1\nstep 2\n"
        "attempt 2 on h2, since 2026-11-28 11:00:00\n"
        "--- output of attempt 2 (bytes 0 to 7 of 7) ---\nstep 3\n"
    )
    document = gpushare("logs", "7", "--json").json()
    assert [a["number"] for a in document["attempts"]] == [1, 2]
    assert document["attempts"][0]["output"]["text"] == "step 1\nstep 2\n"
    assert ("GET", "/api/v1/sandboxes/7/attempts/", None) in gpushare.portal.seen


def test_usage_and_invoices(gpushare: Run) -> None:
    usage = gpushare("usage", "--project", "vision", "--start", "2026-11-01")
    assert "Total of the closed intervals listed: 2.50 EUR" in usage.out and "running" in usage.out
    assert gpushare.portal.seen[-1][:2] == ("GET", "/api/v1/usage/")
    assert gpushare("usage", "--json").json()["total_micros"] == {"EUR": 2500000}
    listed = gpushare("invoices", "--period", "2026-10").out.splitlines()
    assert listed[1].split() == ["3", "VIS-2026-10", "vision", "2026-10", "finalized", "2.50", "EUR"]
    one = gpushare("invoices", "3").out
    assert "invoice:   VIS-2026-10" in one and "1.00" in one


@pytest.mark.parametrize(
    ("status", "body", "code", "says"),
    [
        (404, {"detail": "No Sandbox matches the given query."}, Exit.NOT_FOUND,
         "Not found: No Sandbox matches"),
        (401, {"detail": "This API token expired on 2026-11-01 00:00 UTC: make a new one."}, Exit.AUTH,
         "Token refused: This API token expired"),
        (403, {"detail": "This API token lacks the scope 'read:usage'."}, Exit.REFUSED, "lacks the scope"),
        (429, {"detail": "Request was throttled."}, Exit.RATE_LIMITED,
         "Rate limited: Request was throttled."),
        (500, None, Exit.UNREACHABLE, "answered 500"),
        (200, None, Exit.UNREACHABLE, "is not the gpushare API"),
    ],
)  # fmt: skip
def test_each_failure_has_its_exit_code_and_no_traceback(
    gpushare: Run, status: int, body: Any, code: Exit, says: str
) -> None:
    gpushare.portal.overrides[("GET", "/api/v1/sandboxes/7/")] = lambda request: (
        httpx.Response(status, json=body, headers={"Retry-After": "30"})
        if body is not None
        else httpx.Response(status, text="<html>oops</html>")
    )
    result = gpushare("show", "7")
    assert result.code == code and says in result.err and "Traceback" not in result.err, result.err
    assert gpushare("show", "7", "--json").json()["error"]["kind"] == code.name.lower()


def test_an_unreachable_portal_exits_8(gpushare: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpushare_client import api, commands

    monkeypatch.setattr(commands, "Api", api.Api)  # a real connection this time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the client connects
    gpushare.env["GPUSHARE_URL"] = f"http://127.0.0.1:{port}"
    result = gpushare("list")
    assert result.code == Exit.UNREACHABLE and f"Cannot reach http://127.0.0.1:{port}" in result.err


def test_an_unexpected_error_is_one_line_unless_debugging(
    gpushare: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpushare_client import commands

    def broken(*args: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(commands, "_describe", broken)
    result = gpushare("show", "7")
    assert result.code == Exit.ERROR and "Traceback" not in result.err
    assert "unexpected error: ZeroDivisionError: a bug (GPUSHARE_DEBUG=1 shows where)" in result.err
    gpushare.env["GPUSHARE_DEBUG"] = "1"
    assert "Traceback" in gpushare("show", "7").err


def test_saving_is_private_from_the_first_byte(gpushare: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file exists 0600 before the token is written into it (mkstemp), never 0644."""
    modes: list[int] = []
    real_fdopen = os.fdopen

    def watching(fd: int, *args: Any, **kwargs: Any) -> Any:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", watching)  # the os module config.py writes through
    assert gpushare("login", BASE).code == 0
    assert modes == [0o600]
