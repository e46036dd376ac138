"""DetachedSupervisor: started by one task, closed by another, its end always heard."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleet.aio import DetachedSupervisor, Supervisor

GUARD_S = 10.0


async def test_started_in_one_task_and_closed_in_another() -> None:
    running = asyncio.Event()

    async def child() -> None:
        running.set()
        await asyncio.Event().wait()

    children = DetachedSupervisor("test", lambda s: s.forever("child", child))
    await asyncio.create_task(children.start())  # as a lifespan's start may run
    await asyncio.wait_for(running.wait(), GUARD_S)
    await asyncio.wait_for(asyncio.create_task(children.close()), GUARD_S)
    assert children._owner is not None and children._owner.cancelled()


async def test_an_owner_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    children = DetachedSupervisor("test", lambda s: s.forever("fails", fails, critical=True))
    with caplog.at_level(logging.ERROR, logger="fleet.aio"):
        await children.start()
        assert children._owner is not None
        await asyncio.wait({children._owner}, timeout=GUARD_S)
        await asyncio.sleep(0)  # the done callback runs on the next loop turn
    assert any(r.getMessage() == "test stopped" for r in caplog.records)


async def test_close_is_bounded_when_a_child_swallows_its_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:  # what nats-py's close() did to a cancel
                continue

    def setup(supervisor: Supervisor) -> None:
        supervisor.spawn("stubborn", stubborn())

    children = DetachedSupervisor("test", setup)
    await children.start()
    with caplog.at_level(logging.WARNING, logger="fleet.aio"):
        await asyncio.wait_for(children.close(wait_s=0.2), GUARD_S)
    assert any("did not stop within" in r.getMessage() for r in caplog.records)
    release.set()
    assert children._owner is not None
    await asyncio.wait({children._owner}, timeout=GUARD_S)
