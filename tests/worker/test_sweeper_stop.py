"""The lease loop's stop of its sentinel death watch (fleet.worker.sweeper `_stop`) returns
when the watch drops a cancel, as a loop around a nats-py request can on Python 3.11 (its
wait_for): with a single cancel the lease loop awaited the watch for ever, and the worker
never contended for a lease again (issue 24's seam bench, after a 10 s SIGSTOP)."""

from __future__ import annotations

import asyncio

from fleet.worker.sweeper import _stop


async def test_a_watch_that_drops_its_first_cancel_is_stopped_all_the_same() -> None:
    dropped = 0

    async def watch() -> None:
        nonlocal dropped
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped += 1  # swallowed, as a request's wait_for does when its answer lands

    task = asyncio.create_task(watch())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await _stop(task)
    assert task.cancelled() and dropped == 1
