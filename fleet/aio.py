"""Owned concurrency: every long-lived coroutine is a child of one asyncio.TaskGroup.

`Supervisor` wraps the group. `forever(name, factory)` runs a loop that must never end: when
it raises, the traceback is logged and the loop is restarted after a backoff that doubles up
to a cap (reset after a minute of health); `critical=True` stops the owner instead (the
failure is re-raised out of the group on purpose). `spawn(name, coro)` runs a one-shot child
whose failure is logged with its traceback, never swallowed.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_CAP_S = 30.0
HEALTHY_AFTER_S = 60.0  # a child that ran this long starts its next backoff from the first step


def next_backoff(previous_s: float | None, ran_for_s: float) -> float:
    """The pause before restarting a failed child: doubling, capped, reset by a long run."""
    if previous_s is None or ran_for_s >= HEALTHY_AFTER_S:
        return BACKOFF_FIRST_S
    return min(BACKOFF_CAP_S, previous_s * 2)


class Supervisor:
    """The owner of a process's (or a component's) children. Use as `async with`."""

    def __init__(self, name: str, *, bounded_s: float | None = None) -> None:
        """`bounded_s`: each child, cancelled, gets this long to end (its cancel repeated,
        cancel_and_wait) before it is left behind, logged, so that the owner's end is bounded
        even when a child inside a nats-py call swallows its cancel (the gateway's lifespan:
        without it a shutdown with NATS down took 5 s or hung, README "Tests")."""
        self.name = name
        self.bounded_s = bounded_s
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.restarts: dict[str, int] = {}  # child name -> restarts so far (for logs and tests)

    async def __aenter__(self) -> Supervisor:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._group is not None
        return await self._group.__aexit__(*exc_info)

    def forever(
        self,
        name: str,
        factory: Callable[[], Awaitable[None]],
        *,
        critical: bool = False,
    ) -> asyncio.Task[None]:
        """Run `factory()` for the owner's lifetime; restart it with backoff when it fails."""
        return self._start(name, self._keep_running(name, factory, critical))

    def spawn(
        self, name: str, coro: Coroutine[Any, Any, Any],
        into: set[asyncio.Task[Any]] | None = None,
    ) -> asyncio.Task[Any]:
        """A one-shot child: its failure is logged with the traceback, the owner goes on.
        `into`: a set of the caller's that holds the child until it ends (what it waits on
        at shutdown), kept by the same done callback."""
        # Cancelled before its first step, the wrapper never awaited `coro`: `_start` closes
        # it, or Python warns "coroutine ... was never awaited" (a standby's watch cancelled
        # at once).
        task = self._start(name, self._logged(name, coro), unstarted=coro, into=into)
        if into is not None:
            into.add(task)
        return task

    async def cancel_all(self) -> None:
        """Cancel every child and wait for them (the group itself stays usable)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def children(self) -> int:
        return len(self._tasks)

    def _start(
        self, name: str, coro: Coroutine[Any, Any, Any], *,
        unstarted: Coroutine[Any, Any, Any] | None = None,
        into: set[asyncio.Task[Any]] | None = None,
    ) -> asyncio.Task[Any]:
        """`unstarted`: a coroutine inside `coro` to close should the child end before
        awaiting it. One done callback does all of a child's bookkeeping: each callback is a
        turn of the event loop of its own, and a task's ending was four (issue 23)."""
        if self._group is None:
            raise RuntimeError(f"{self.name}: supervisor used outside `async with`")
        inner = coro
        if self.bounded_s is not None:
            coro = self._bounded(name, inner, self.bounded_s)
        unstarted_ones = [unstarted] if unstarted is not None else []
        if inner is not coro:
            unstarted_ones.append(inner)
        task = self._group.create_task(coro, name=f"{self.name}/{name}")
        self._tasks.add(task)
        tasks = self._tasks

        def ended(task: asyncio.Task[Any]) -> None:
            tasks.discard(task)
            if into is not None:
                into.discard(task)
            for each in unstarted_ones:
                _close_unstarted(each)

        task.add_done_callback(ended)
        return task

    async def _bounded(
        self, name: str, coro: Coroutine[Any, Any, Any], wait_s: float
    ) -> Any:
        # This wrapper owns `work` (it is the group's child): `coro` is the `_logged` or
        # `_keep_running` wrapper, which logs the failure, even of work left behind.
        work = asyncio.create_task(coro, name=f"{self.name}/{name} (work)")
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if await cancel_and_wait({work}, wait_s):
                log.warning("%s/%s did not stop within %.0f s; left behind",
                            self.name, name, wait_s)
            raise

    async def _logged(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s/%s failed", self.name, name)
            return None

    async def _keep_running(
        self, name: str, factory: Callable[[], Awaitable[None]], critical: bool
    ) -> None:
        backoff: float | None = None
        while True:
            started = time.monotonic()
            try:
                await factory()
                log.error("%s/%s returned; it must run until stopped: restarting", self.name, name)
            except asyncio.CancelledError:
                raise
            except Exception:
                if critical:
                    log.exception("%s/%s failed: stopping %s", self.name, name, self.name)
                    raise
                log.exception("%s/%s failed: restarting", self.name, name)
            backoff = next_backoff(backoff, time.monotonic() - started)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            await asyncio.sleep(backoff)  # a restart backoff, not synchronisation


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    """Close a coroutine its task never started (else Python warns it was never awaited);
    one that started is its task's, even one left behind still running."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def started(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """A task its caller keeps, awaits or cancels itself (the caller is its owner); its
    failure is logged here when it ends, so that no owner's forgetting drops it silently."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(log_failure)
    return task


def log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed: %r", task.get_name(), exc, exc_info=exc)


class TaskSet:
    """The owner of tasks started outside any Supervisor (a process-wide span processor's
    flushes): each referenced until done, its failure logged."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any],
              context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        log_failure(task)


CLOSE_WAIT_S = 5.0
RECANCEL_S = 0.1


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], wait_s: float = CLOSE_WAIT_S
) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait up to `wait_s` for them to end; those still running are
    returned. The cancel is repeated until each ends: Python 3.11's asyncio.wait_for, inside
    every nats-py request, drops a cancel that lands as its answer arrives (gh-86296, fixed
    in 3.12), and a loop around such a call then runs on (one cancel in two was lost so in a
    loop of KV reads; gateway shutdowns in the tests took 5 s or hung)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    return pending


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` is set within `seconds` (a loop's period, or a wake that cuts it
    short). Not `asyncio.wait_for`: on Python 3.11 it drops a cancel that lands as the event
    is set (it returns instead of raising), and a loop waiting on its period so ran on after
    its owner cancelled it: a worker's failover sweep hung a test's teardown 1 run in 2-3.
    `asyncio.timeout` keeps the cancel."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
