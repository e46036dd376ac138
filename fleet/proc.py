"""How Fleet's long-running commands end: promptly on SIGTERM in every state, and without
leaving children behind.

- `Exit` turns the first SIGINT/SIGTERM into a stop request and arms a deadline; a second
  signal, or the deadline, ends the process at once (after its last rites: stopping children
  such as the embedded nats-server). A clean stop that hangs on a broker that is down, a
  runner still starting or a model conversion still running cannot keep the process alive.
- `run_main` runs a command's coroutine and leaves with `os._exit` once it is done. mlx keeps
  native threads alive after a model conversion in this process; a normal interpreter exit
  then destroys them while joinable and the C++ runtime aborts ("terminate called without an
  active exception"). asyncio.run would also wait for a conversion thread to finish. Our own
  cleanup has run by then, so there is nothing left that a normal exit would do for us.
- `guard_child(pid)` kills a child when this process dies, even by SIGKILL: a watchdog in its
  own session holds a pipe from us; the pipe closing without a goodbye means we are gone.
- `die_with_parent` is the Linux-only alternative for a Popen `preexec_fn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

log = logging.getLogger(__name__)

STOP_GRACE_S = 8.0  # from the first signal to a forced exit
PR_SET_PDEATHSIG = 1


class Exit:
    """The stop request of one process, and its forced exit."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self.stopping = asyncio.Event()
        self._rites: list[Callable[[], None]] = []
        self._callbacks: list[Callable[[], None]] = []
        self._timer: threading.Timer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> Exit:
        """Handle SIGINT/SIGTERM. A plain signal handler, not the loop's: it runs between
        bytecodes even while the loop never yields (a livelocked coroutine), so the
        deadline is armed whatever the loop is doing."""
        self._loop = loop or asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Called (on the loop) when the stop is requested."""
        self._callbacks.append(callback)
        if self.stopping.is_set():
            callback()

    def at_forced_exit(self, rite: Callable[[], None]) -> None:
        """Run (from any thread) just before a forced or final exit: stop children."""
        self._rites.append(rite)

    def request(self, why: str) -> None:
        """Ask for a stop (on the loop's thread): set `stopping`, run the callbacks."""
        if self.stopping.is_set():
            return
        log.info("%s: stopping (forced in %.0f s; a second signal forces it now)",
                 why, self.grace_s)
        self._arm()
        self.stopping.set()
        for callback in self._callbacks:
            callback()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.grace_s, self._overdue)
            self._timer.daemon = True
            self._timer.start()

    def _on_signal(self, sig: int, frame: object) -> None:
        name = signal.Signals(sig).name
        if self._signalled:
            log.warning("%s again: exiting now", name)
            self.leave(128 + sig)
        self._signalled = True
        self._arm()  # here, not on the loop: the loop may be the thing that is stuck
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.request, name)

    def _overdue(self) -> None:
        log.warning("a clean stop took over %.0f s: exiting now", self.grace_s)
        self.leave(1)

    def leave(self, code: int) -> NoReturn:
        """Run the last rites, flush what is buffered, and exit without native teardown."""
        for rite in self._rites:
            with contextlib.suppress(Exception):
                rite()
        flush_and_exit(code)


def flush_and_exit(code: int) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_main(main: Callable[[Exit], Coroutine[Any, Any, int | None]],
             grace_s: float = STOP_GRACE_S) -> NoReturn:
    """Run `main(exit)` on a fresh event loop with signals installed, then leave the process
    with its status. Errors are reported like `fleet` reports them."""
    from fleet import gc_policy
    from fleet.errors import FleetError

    gc_policy.serving_thresholds()
    exit_ = Exit(grace_s)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    exit_.install(loop)
    code = 0
    try:
        code = loop.run_until_complete(main(exit_)) or 0
    except FleetError as exc:
        print(f"fleet: {exc.message}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_.leave(code)


class ChildGuard:
    """A watchdog that SIGTERMs `pid` when this process dies without calling `release`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # `read` returns at EOF (we died: the kernel closed our end) or at "ok" (we stopped
        # the child ourselves, so its pid may be reused: never signal it then).
        script = f'read -r line; [ "$line" = ok ] || kill -TERM {pid} 2>/dev/null'
        self.process = subprocess.Popen(
            ["/bin/sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,  # survives our process group
        )

    def release(self) -> None:
        """The child was stopped on purpose: the watchdog ends without a signal."""
        if self.process.stdin is None or self.process.stdin.closed:
            return
        with contextlib.suppress(OSError):
            self.process.stdin.write(b"ok\n")
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(2.0)


def guard_child(pid: int) -> ChildGuard | None:
    """A ChildGuard for `pid`, or None where there is no POSIX shell."""
    if not os.path.exists("/bin/sh"):
        return None
    return ChildGuard(pid)


def die_with_parent() -> None:
    """A Popen `preexec_fn`: the child gets SIGTERM when the thread that started it dies
    (Linux; elsewhere a no-op). Start children from the main thread for that reason."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
