"""The operator's checkpoint hook, run before a sandbox is stopped for a fleet plan's move
(workers/moves.py) or warned of its preemption (workers/host/lifecycle.py).

``SANDBOX_CHECKPOINT_HOOK`` names an executable run as ``<hook> checkpoint`` with the
sandbox in its environment (``GPUSHARE_SANDBOX_ID``, ``GPUSHARE_ALLOCATION_KEY``,
``GPUSHARE_DRIVER``, ``GPUSHARE_SANDBOX_REF``) and why (``GPUSHARE_CHECKPOINT_REASON``:
``move`` with ``GPUSHARE_PLAN_ID``, or ``preemption`` with ``GPUSHARE_STOP_AT``, the epoch
second of the stop, and ``GPUSHARE_STOP_IN_S``). It
might ask the job to save its state, or run CRIU.

Beside the host agent's parts (workers/host/), which read no environment: the hook is given
the agent's own environment, with the sandbox's variables added.
"""

from __future__ import annotations

import os
import subprocess
import time

from wire.spec import SandboxHandle


def run_checkpoint_hook(
    handle: SandboxHandle, hook: str, timeout: float, why: dict[str, str]
) -> tuple[bool, str] | None:
    """Run the hook for one sandbox: (ok, what it said), None without a hook (``hook`` "-")."""
    if hook == "-":
        return None
    env = {
        **os.environ,
        "GPUSHARE_SANDBOX_ID": str(handle.sandbox_id),
        "GPUSHARE_ALLOCATION_KEY": handle.allocation_key,
        "GPUSHARE_ALLOCATION_ID": handle.allocation_key,  # its old name, for hooks written then
        "GPUSHARE_DRIVER": handle.driver,
        "GPUSHARE_SANDBOX_REF": handle.ref,
        **why,
    }
    started = time.monotonic()
    try:
        done = subprocess.run(  # noqa: S603 - the operator's own hook, no shell
            [hook, "checkpoint"], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"checkpoint hook {hook} ran past {timeout:g} s"
    except OSError as exc:
        return False, f"checkpoint hook {hook} could not run: {exc}"
    took = time.monotonic() - started
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
    if done.returncode != 0:
        return False, f"checkpoint hook exited with {done.returncode}: {said[0]}"[:300]
    return True, f"checkpoint done in {took:.1f} s" + (f": {said[0]}" if said[0] else "")
