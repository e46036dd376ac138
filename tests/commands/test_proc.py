"""fleet.proc: the forced exit works even when the loop never yields, a second signal exits
at once, and a ChildGuard kills its child only when its owner dies without a goodbye."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from fleet.proc import ChildGuard

LIVELOCK = textwrap.dedent("""
    import asyncio, sys
    from fleet.proc import run_main

    async def main(exit_):
        print("spinning", flush=True)
        while True:  # a coroutine that never yields: the loop can run nothing else
            pass

    run_main(main, grace_s=float(sys.argv[1]))
""")


def spinning(grace_s: float) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", LIVELOCK, str(grace_s)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "spinning"
    return process


def test_a_livelocked_loop_is_ended_by_the_deadline_after_sigterm() -> None:
    process = spinning(grace_s=1.0)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(10)
    assert code == 1 and time.monotonic() - started < 5
    assert "exiting now" in (process.stdout.read() if process.stdout else "")


def test_a_second_signal_exits_at_once() -> None:
    process = spinning(grace_s=60.0)
    # Two different signals: the kernel merges a signal that is already pending.
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGINT)
    assert process.wait(10) in (128 + signal.SIGINT, 128 + signal.SIGTERM)


def test_a_guard_kills_its_child_when_the_owner_vanishes_and_not_after_a_goodbye() -> None:
    for goodbye in (False, True):
        child = subprocess.Popen(["sleep", "60"])
        guard = ChildGuard(child.pid)
        if goodbye:
            guard.release()
        else:
            assert guard.process.stdin is not None
            guard.process.stdin.close()  # what the kernel does when the owner dies
            guard.process.wait(10)
        try:
            if goodbye:
                assert child.poll() is None  # still running: released, never signalled
            else:
                assert child.wait(10) == -signal.SIGTERM
        finally:
            child.kill()
            child.wait(10)
            assert not psutil.pid_exists(guard.process.pid) or guard.process.poll() is not None


PARENT = textwrap.dedent("""
    import subprocess, sys
    from fleet.proc import die_with_parent

    child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent)
    print(child.pid, flush=True)
    child.wait()
""")


def test_die_with_parent_ends_the_child_when_its_parent_is_killed() -> None:
    if not sys.platform.startswith("linux"):
        return  # a no-op elsewhere, by design
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait(10)
    gone, alive = psutil.wait_procs([child], timeout=10)
    for process in alive:
        process.kill()
    assert gone and not alive
