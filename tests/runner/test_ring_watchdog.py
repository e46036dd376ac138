"""The ring watchdog follows its runner: a runner killed while it waits for its ring (a rank
moved away) closes its report pipe at once, so its worker sees it gone and restarts the shard
into the new ring, instead of waiting for the watchdog's timeout (fleet/runner/ring.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A runner stand-in: the watchdog armed for a minute around a block that never ends.
CHILD = """
import sys, time
from fleet.runner.ring import _watchdog
with _watchdog(60.0, lambda: print("last words", flush=True)):
    print("waiting", flush=True)
    time.sleep(60)
"""


def test_a_killed_runner_s_pipe_closes_without_waiting_for_its_watchdog() -> None:
    process = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    assert process.stdout is not None
    try:
        assert process.stdout.readline() == b"waiting\n"
        os.kill(process.pid, signal.SIGKILL)
        started = time.monotonic()
        rest = process.stdout.read()  # until every writer of the pipe is gone
        ended_after = time.monotonic() - started
    finally:
        process.kill()
        process.wait(10)
    assert rest == b"", "the watchdog spoke: it outlived its runner"
    # Far below the watchdog's 60 s (the pipe stayed open that long before the fix).
    assert ended_after < 30, ended_after
