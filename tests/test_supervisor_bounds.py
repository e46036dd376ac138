"""The gateway lifespan's Supervisor (fleet/aio.py, `bounded_s`): its end is bounded even when
a child swallows its cancel (as one inside a nats-py call did: README "Tests"), a child's
failure is logged, and it may be left by another task than the one that entered it (the
suite's fixtures do so)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleet.aio import Supervisor

GUARD_S = 10.0


async def test_the_end_is_bounded_when_a_child_swallows_its_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    running = asyncio.Event()

    async def stubborn() -> None:
        running.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:  # what nats-py's wait_for did to a cancel
                continue

    with caplog.at_level(logging.WARNING, logger="fleet.aio"):
        async with asyncio.timeout(GUARD_S):
            async with Supervisor("test", bounded_s=0.2) as owner:
                owner.spawn("stubborn", stubborn())
                await running.wait()
                await owner.cancel_all()
    assert any(r.getMessage() == "test/stubborn did not stop within 0 s; left behind"
               for r in caplog.records)
    release.set()  # the left-behind work ends


async def test_a_child_that_fails_is_logged_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="fleet.aio"):
        async with Supervisor("test", bounded_s=0.2) as owner:
            failed = owner.spawn("fails", fails())
            other = owner.spawn("other", asyncio.Event().wait())
            await asyncio.wait_for(asyncio.shield(failed), GUARD_S)
            assert not other.done()
            await owner.cancel_all()
    assert any(r.getMessage() == "test/fails failed" and r.exc_info for r in caplog.records)


async def test_entered_in_one_task_and_left_in_another() -> None:
    owner = Supervisor("test", bounded_s=0.2)
    running = asyncio.Event()

    async def child() -> None:
        running.set()
        await asyncio.Event().wait()

    await asyncio.create_task(owner.__aenter__())  # as a fixture's setup
    owner.forever("child", child)
    await asyncio.wait_for(running.wait(), GUARD_S)

    async def leave() -> None:  # as its teardown
        await owner.cancel_all()
        await owner.__aexit__(None, None, None)

    await asyncio.wait_for(asyncio.create_task(leave()), GUARD_S)
    assert owner.children == 0


@pytest.mark.parametrize("bounded_s", [None, 0.2])
async def test_a_child_leaves_the_owner_and_its_callers_set_as_it_ends(
    bounded_s: float | None,
) -> None:
    release = asyncio.Event()
    mine: set[asyncio.Task[object]] = set()
    async with Supervisor("test", bounded_s=bounded_s) as owner:
        child = owner.spawn("child", release.wait(), into=mine)
        assert mine == {child} and owner.children == 1
        release.set()
        # Its done callbacks run in the order they were added: ours, then shield's.
        await asyncio.wait_for(asyncio.shield(child), GUARD_S)
        assert mine == set() and owner.children == 0


@pytest.mark.parametrize("bounded_s", [None, 0.2])
async def test_a_child_cancelled_before_it_started_closes_its_coroutine(
    bounded_s: float | None,
) -> None:
    async def never() -> None:
        raise AssertionError("not started")

    coro = never()
    async with Supervisor("test", bounded_s=bounded_s) as owner:
        child = owner.spawn("child", coro)
        child.cancel()
    assert child.cancelled()
    assert coro.cr_frame is None  # closed: no "was never awaited" warning
