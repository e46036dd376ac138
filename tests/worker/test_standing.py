"""Standing pull requests (fleet.worker.standing): the rules as tables, and against a real
nats-server a fetch that sends a covered class no pull and takes its task from the request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.tasks import Priority
from fleet.worker.pull_now import next_delivered
from fleet.worker.pulls import TaskPuller
from fleet.worker.standing import Cover, Step, covered, round_step, stands

OPEN = Cover(until=10.0, reconnects=2)


@pytest.mark.parametrize(("cover", "held", "now", "reconnects", "expected"), [
    (OPEN, 0, 5.0, 2, True),  # open, nothing brought: the class holds no task
    (None, 0, 5.0, 2, False),  # no request of ours: pull it
    (OPEN, 1, 5.0, 2, False),  # it brought a task: more may be queued behind it
    (OPEN, 0, 10.0, 2, False),  # expired by our clock: the server may have dropped it
    (OPEN, 0, 5.0, 3, False),  # reconnected since: a restarted server forgot it
])
def test_a_class_is_covered_only_by_an_open_request_that_brought_nothing(
    cover: Cover | None, held: int, now: float, reconnects: int, expected: bool,
) -> None:
    assert covered(cover, held, now, reconnects) is expected


@pytest.mark.parametrize(("wanted", "is_covered", "expected"), [
    (0, False, Step.SKIP),
    (0, True, Step.SKIP),
    (3, True, Step.COVERED),
    (3, False, Step.PULL),
])
def test_a_rounds_step(wanted: int, is_covered: bool, expected: Step) -> None:
    assert round_step(wanted, is_covered) is expected


@pytest.mark.parametrize(("delivered", "free_left", "expected"), [
    (True, 2, True),
    (True, 0, False),  # no slot left for another: its task would only wait here
    (False, 2, False),  # its request is still open (a cancelled wait's)
])
def test_a_class_stands_after_its_wait_took_a_task_and_a_slot_is_left(
    delivered: bool, free_left: int, expected: bool,
) -> None:
    assert stands(delivered, free_left) is expected


async def _fetch_when_published(puller: TaskPuller, js: JetStreamContext, batch: int,
                                data: bytes, priority: Priority = "default") -> list[Msg]:
    """Publish once the fetch waits (its round found nothing), so the wait takes the task."""
    waits = asyncio.Event()
    first_of = puller._first_of

    async def entered(*args: Any) -> list[Msg]:
        waits.set()
        return await first_of(*args)

    puller._first_of = entered  # type: ignore[method-assign]
    try:
        waiting = asyncio.ensure_future(puller.fetch("m", batch))
        await asyncio.wait_for(waits.wait(), 30)
        await js.publish(subjects.tasks("m", priority), data)
    finally:
        puller._first_of = first_of  # type: ignore[method-assign]
    got = await asyncio.wait_for(waiting, 30)
    for msg in got:
        await msg.ack()
    return got


async def test_a_covered_class_gets_no_pull_and_its_task_comes_through_its_request(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    pulls: list[tuple[str, float | None]] = []
    pull = puller._pull

    async def counted(model: str, priority: Priority, batch: int,
                      wait_s: float | None) -> list[Msg]:
        pulls.append((priority, wait_s))
        return await pull(model, priority, batch, wait_s)

    puller._pull = counted  # type: ignore[method-assign]
    try:
        got = await _fetch_when_published(puller, js, 4, b"first")
        assert [m.data for m in got] == [b"first"]
        # Its class stands again (3 slots left); the others' cancelled waits stand too.
        assert all(puller._covered("m", p) for p in ("interactive", "default", "batch"))

        sweep = puller.sweeps[("m", "default")]

        pulls.clear()
        got = await _fetch_when_published(puller, js, 3, b"second")
        assert [m.data for m in got] == [b"second"]
        assert pulls == []  # no no_wait round, no new request: the standing ones brought it
        # Its request spent, the next one is posted and read by the same sweep.
        assert puller.sweeps[("m", "default")] is sweep and puller._covered("m", "default")

        # Published while no fetch runs: the request holds it for the next fetch.
        await js.publish(subjects.tasks("m", "default"), b"third")
        deadline = time.monotonic() + 10
        while not puller.strays.get(("m", "default")) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling the sweep, bounded
        got = await puller.fetch("m", 2)
        assert [m.data for m in got] == [b"third"]
        await got[0].ack()

        # A higher class is served first whatever stands.
        got = await _fetch_when_published(puller, js, 2, b"urgent", "interactive")
        assert [m.data for m in got] == [b"urgent"]
    finally:
        await puller.close()


async def test_a_class_whose_request_was_spent_with_no_slot_left_is_uncovered(
    provisioned_nc: Client,
) -> None:
    """Its wait took the last slot's task: no request is posted again and its sweep ends, so
    the class's next fetch pulls it (the spent request would bring nothing)."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        await _fetch_when_published(puller, js, 4, b"first")
        got = await _fetch_when_published(puller, js, 1, b"last slot")
        assert [m.data for m in got] == [b"last slot"]
        assert not puller._covered("m", "default")
        assert ("m", "default") not in puller.sweeps
        await js.publish(subjects.tasks("m"), b"next")
        got = await puller.fetch("m", 1)
        assert [m.data for m in got] == [b"next"]
        await got[0].ack()
    finally:
        await puller.close()


async def test_a_reconnect_uncovers_every_class(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        await _fetch_when_published(puller, js, 4, b"first")
        assert puller._covered("m", "default")
        provisioned_nc.stats["reconnects"] += 1  # what a reconnect counts
        assert not any(puller._covered("m", p) for p in ("interactive", "default", "batch"))
    finally:
        provisioned_nc.stats["reconnects"] -= 1
        await puller.close()


async def test_next_delivered_reads_a_subscription_as_next_msg_does(
    provisioned_nc: Client,
) -> None:
    """The sweep's read: the next message, its pending size given back; TimeoutError when
    none comes in time (as nats-py's next_msg)."""
    sub = await provisioned_nc.subscribe("sweep.test")
    try:
        await provisioned_nc.publish("sweep.test", b"one")
        msg = await next_delivered(sub, 5.0)
        assert msg.data == b"one" and sub.pending_bytes == 0
        with pytest.raises(TimeoutError):
            await next_delivered(sub, 0.05)
    finally:
        await sub.unsubscribe()
