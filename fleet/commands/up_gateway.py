"""`fleet up --up-processes split`: the gateway as a child process of `fleet up`.

One Python process carrying the worker and the gateway was the ceiling of a node's token rate
(issue 23: 94 % of one core at ~11,000 tok/s, bench/README.md "Plumbing at rate"); apart,
each has a core's worth to use. The child is `fleet gateway`, given what `fleet up` decided:

- its settings as FLEET_* variables (`settings_env`: the gateway role's credentials when
  secured, the embedded server's URL), so it reads exactly what the in-process gateway would;
- the listening socket `fleet up` bound before anything started (inherited, `--listen-fd`):
  a taken port still fails `fleet up` before NATS starts, and connections queue meanwhile.

It is owned by `fleet up` (`gateway_process`, one role of its task group): readiness is its
/healthz as before (fleet.commands.stack.serves_requests), a stop sends it SIGTERM and waits
for its graceful end (then SIGKILL), an exit before the stop fails `fleet up` with the
child's exit status (`RoleExited`), and it dies with `fleet up` even on a SIGKILL (its own
session, away from the terminal's Ctrl-C, with a parent-death signal and a ChildGuard).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from fleet import config
from fleet.config import Settings
from fleet.errors import FleetError
from fleet.proc import die_with_parent, guard_child

log = logging.getLogger(__name__)

# The child's own stop: its open streams get fleet.gateway.app.GRACEFUL_SHUTDOWN_S, then
# this margin for its exit.
STOP_MARGIN_S = 2.0


class RoleExited(FleetError):
    """A child role of `fleet up` exited while `fleet up` served: `fleet up` exits with its
    status (128 + N for a signal N, as a shell says it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def exit_status(returncode: int) -> int:
    """A child's returncode as an exit status to pass on: -N (signal N) is 128 + N; a clean
    0 while it should have run on is a failure all the same (1)."""
    if returncode < 0:
        return 128 - returncode
    return returncode or 1


def settings_env(settings: Settings) -> dict[str, str]:
    """FLEET_* variables that make `load_settings` give `settings` back (flags none): an
    empty variable is unset (fleet.config), so an empty value leaves its default."""
    env: dict[str, str] = {}
    for name in config.NAMES:
        value = getattr(settings, name)
        if value is None or value == ():
            text = ""
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = ",".join(value)
        else:
            text = os.fspath(value) if isinstance(value, Path) else str(value)
        env[config.env_var(name)] = text
    return env


def gateway_command(fd: int) -> list[str]:
    return [sys.executable, "-m", "fleet.cli", "gateway", "--listen-fd", str(fd)]


async def gateway_process(
    settings: Settings, sock: socket.socket, started: asyncio.Event,
    at_forced_exit: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Run `fleet gateway` on `sock` until cancelled (then stop it); raises RoleExited if it
    exits first. `started` is set once it runs (its /healthz says when it serves)."""
    fd = sock.fileno()
    process = await asyncio.create_subprocess_exec(
        *gateway_command(fd), env={**os.environ, **settings_env(settings)}, pass_fds=(fd,),
        start_new_session=True, preexec_fn=die_with_parent,
    )
    guard = guard_child(process.pid)
    if at_forced_exit is not None:  # `fleet up` forced out: the child goes too
        at_forced_exit(lambda: _signal(process, signal.SIGKILL))
    log.info("gateway process %d started", process.pid)
    started.set()
    try:
        returncode = await process.wait()
    except asyncio.CancelledError:
        await _stop(process)
        raise
    finally:
        if guard is not None:
            guard.release()
    raise RoleExited(f"the gateway process exited with code {returncode} while `fleet up` "
                     "ran", exit_status(returncode))


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (its graceful stop), then SIGKILL if it overruns; waits for its end."""
    from fleet.gateway.app import GRACEFUL_SHUTDOWN_S  # not at import: `fleet worker` needs none

    _signal(process, signal.SIGTERM)
    grace = GRACEFUL_SHUTDOWN_S + STOP_MARGIN_S
    try:
        returncode = await asyncio.wait_for(asyncio.shield(process.wait()), grace)
    except TimeoutError:
        log.warning("gateway process %d did not stop within %.0f s: killing it",
                    process.pid, grace)
        _signal(process, signal.SIGKILL)
        returncode = await process.wait()
    if returncode != 0:
        log.warning("gateway process %d ended with code %d", process.pid, returncode)


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
