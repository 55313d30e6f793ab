"""``--wait``: follow a sandbox until it runs, saying what changes on the way (its state,
why it waits, what its host is doing, e.g. pulling its image), and ending with an error when
it fails, ends or the time is up. A batch run that ran and already ended (its command is
done) counts as having run: its output is for ``gpushare logs``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpushare_client.api import Api
from gpushare_client.exits import ClientError, Exit
from gpushare_client.render import progress_line
from gpushare_client.routes import SANDBOX

ENDED = frozenset({"stopped", "failed", "preempted", "expired"})
POLL_S = 1.0


def ran_to_its_end(sandbox: dict[str, Any]) -> bool:
    """A batch run that started and then stopped by itself: its command ran and is done."""
    return bool(sandbox.get("batch") and sandbox.get("started_at") and sandbox.get("state") == "stopped")


def wait_until_running(
    api: Api,
    sandbox: dict[str, Any],
    *,
    timeout_s: float | None,
    say: Callable[[str], None],
    every_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """The sandbox once it runs. A portal that stops answering for a while (a restart) is
    asked again until the timeout; a refusal or a 404 ends the wait at once."""
    every_s = POLL_S if every_s is None else every_s
    sleep = sleep or time.sleep
    deadline = None if timeout_s is None else clock() + timeout_s
    said = ""
    while True:
        line = progress_line(sandbox)
        if line != said:
            say(line)
            said = line
        state = sandbox.get("state")
        if state == "running" or ran_to_its_end(sandbox):
            return sandbox
        if state in ENDED:
            why = sandbox.get("failure") or sandbox.get("pending_reason") or "no reason given"
            raise ClientError(
                Exit.SANDBOX_ENDED, f"Sandbox {sandbox.get('id')} {state} instead of running: {why}",
                document={"sandbox": sandbox},
            )  # fmt: skip
        if deadline is not None and clock() >= deadline:
            raise ClientError(
                Exit.TIMED_OUT,
                f"Sandbox {sandbox.get('id')} is still {state} after {timeout_s:g} s; it stays "
                f"requested (gpushare stop {sandbox.get('id')} withdraws it).",
                document={"sandbox": sandbox},
            )
        sleep(every_s)
        try:
            sandbox = api.call(SANDBOX, id=sandbox["id"])
        except ClientError as exc:
            if exc.code != Exit.UNREACHABLE:
                raise
            if exc.message not in said:
                say(f"{exc.message} Asking again.")
                said = exc.message
