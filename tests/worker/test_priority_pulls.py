"""The priority pull against a real nats-server: highest class first, batch leaves the
reserve, and a pull waiting on an empty queue takes the first task of any class."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import ServiceUnavailableError

from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.tasks import Priority
from fleet.worker.priority import Turn
from fleet.worker.pulls import FETCH_WAIT_S, SLACK_WAIT_S, TaskPuller


async def test_a_pull_takes_the_highest_class_first_and_batch_only_slack(
    provisioned_nc: Client,
) -> None:
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        for priority in ("batch", "default", "interactive"):  # published lowest first
            for n in range(2):
                await js.publish(subjects.tasks("m", priority), f"{priority}-{n}".encode())
        got = await puller.fetch("m", 3, reserve=1)
        assert [m.data for m in got] == [b"interactive-0", b"interactive-1", b"default-0"]
        got += await puller.fetch("m", 3, reserve=1)  # batch may take 3 - 1 (default) - 1
        assert [m.data for m in got[3:]] == [b"default-1", b"batch-0"]
        got += await puller.fetch("m", 1, reserve=1)  # the last free slot is not batch's
        assert len(got) == 5
        for msg in got:
            await msg.ack()

        waiting = asyncio.ensure_future(puller.fetch("m", 1, reserve=1))
        await asyncio.sleep(0)  # only to let the pull start; the wait below is on the task
        await js.publish(subjects.tasks("m", "interactive"), b"late")
        late = await asyncio.wait_for(waiting, 30)
        if not late:  # published before the wait began: the next pull finds it at once
            late = await puller.fetch("m", 1, reserve=1)
        assert [m.data for m in late] == [b"late"]
        info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable("m", "batch"))
        assert info.num_pending == 1  # batch-1 still queued
    finally:
        await puller.close()


async def test_a_class_that_cannot_be_pulled_leaves_the_others_pulled(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interactive class's pull fails (fault injected: as when its consumer's leader is
    paused, the broker does not answer): the default class's tasks still come (a fault test
    once saw a worker pull nothing at all while one class's consumer was away)."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    real_pull = puller._pull

    async def pull(model: str, priority: Priority, batch: int,
                   wait_s: float | None) -> list[Msg]:
        if priority == "interactive":
            raise TimeoutError("fault injected: the interactive consumer does not answer")
        return await real_pull(model, priority, batch, wait_s)

    monkeypatch.setattr(puller, "_pull", pull)
    try:
        await js.publish(subjects.tasks("m", "default"), b"default-0")
        got = await puller.fetch("m", 2)
        assert [m.data for m in got] == [b"default-0"]
        for msg in got:
            await msg.ack()
    finally:
        await puller.close()


async def test_a_preemption_probe_holds_the_models_pull_only_briefly(
    provisioned_nc: Client,
) -> None:
    """A full worker's probe for an interactive task (`only`) with none waiting returns
    after SLACK_WAIT_S, not FETCH_WAIT_S: while it waits, a slot that frees gets no pull (a
    fault-engine stack of 22 NATS clients on 2 slots ran 16 tasks in 15 s so, 132 after)."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        await js.publish(subjects.tasks("m"), b"default-0")  # not the probe's class
        began = time.monotonic()
        assert await puller.fetch("m", 1, only="interactive") == []
        assert time.monotonic() - began < SLACK_WAIT_S + 0.6 < FETCH_WAIT_S
        got = await puller.fetch("m", 1)
        assert [m.data for m in got] == [b"default-0"]
        await got[0].ack()
    finally:
        await puller.close()


async def test_an_interrupted_wait_ends_at_once_and_loses_no_task(
    provisioned_nc: Client,
) -> None:
    """A probe's wait ended by a freed slot (`interrupt`) returns without waiting its time
    out, and a task that arrives just after is taken by the next pull (the cancelled wait's
    request is swept, its message kept for that pull), not left to AckWait."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    try:
        interrupt = asyncio.Event()
        await puller.fetch("m", 1, only="interactive")  # binds the class's durable
        wait = asyncio.ensure_future(
            puller._first_of("m", [Turn("interactive")], 30.0, interrupt))
        await asyncio.sleep(0.1)  # the wait is out (a span, not a synchronisation)
        began = time.monotonic()
        interrupt.set()
        assert await asyncio.wait_for(wait, 10) == []
        assert time.monotonic() - began < 10 < 30
        await js.publish(subjects.tasks("m", "interactive"), b"late")
        got: list[Msg] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = await puller.fetch("m", 1, only="interactive")
        assert [m.data for m in got] == [b"late"]
        await got[0].ack()
    finally:
        await puller.close()



@pytest.mark.parametrize("passes", range(6))
async def test_a_wait_cancelled_as_its_task_arrives_keeps_the_task(
    provisioned_nc: Client, passes: int,
) -> None:
    """`_first_of` cancels the waits that did not answer first (another class's task, a
    standing request's end, a probe's interrupt). A task delivered to such a wait as its
    cancel lands, in any loop pass from its delivery on, is returned by the wait or left
    queued for the class's next pull; never taken and dropped, to come back only after
    AckWait (nats-py's fetch did so: its next_msg takes the message in a task of its own,
    and a cancel landing between that task's end and the fetch's resumption dropped it;
    a quick bench's HTTP stream stalled ~27 s, CI 15:04)."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    loop = asyncio.get_running_loop()
    try:
        queue = (await puller._subscribe("m"))._sub._pending_queue
        wait = asyncio.ensure_future(puller._pull("m", "default", 1, 30.0))
        deliver = queue.put_nowait

        def delivered(msg: Msg) -> None:
            """The client's read loop queueing the task: the cancel lands `passes` loop
            passes later (the pass is what is tested, so it is counted, not waited for)."""
            deliver(msg)

            def hop(left: int) -> None:
                if left:
                    loop.call_soon(hop, left - 1)
                else:
                    wait.cancel()

            hop(passes)

        queue.put_nowait = delivered  # type: ignore[method-assign]
        await js.publish(subjects.tasks("m"), b"task")
        got: list[Msg] = []
        with contextlib.suppress(asyncio.CancelledError):
            got = await asyncio.wait_for(wait, 30)
        queue.put_nowait = deliver  # type: ignore[method-assign]
        if not got:  # cancelled before it took the task: queued, the next pull's first
            got = await puller._pull("m", "default", 1, None)
        assert [m.data for m in got] == [b"task"]
        await got[0].ack()
    finally:
        await puller.close()


@pytest.mark.parametrize("failing", ["interactive", "default"])
async def test_a_class_wait_that_fails_keeps_what_the_other_classes_brought(
    provisioned_nc: Client, monkeypatch: pytest.MonkeyPatch, failing: Priority,
) -> None:
    """`_first_of` waits on every class at once. One class's wait that fails (fault
    injected: its durable answers 503, as while it is deleted or its leader elected) in the
    loop pass where another class's wait brought a task must not drop that task: delivered
    and unacked, it came back only after AckWait (30 s). The task is returned, and the
    failure is not lost either: the failing class is looked after (`_recover`)."""
    js = provisioned_nc.jetstream()
    puller = TaskPuller(provisioned_nc, js, Settings())
    real_pull = puller._pull
    recovered: list[str] = []
    real_recover = puller._recover

    async def pull(model: str, priority: Priority, batch: int,
                   wait_s: float | None) -> list[Msg]:
        if priority == failing:
            raise ServiceUnavailableError(description="fault injected: no responders")
        return await real_pull(model, priority, batch, wait_s)

    async def recover(model: str) -> None:
        recovered.append(model)
        await real_recover(model)

    try:
        brought: Priority = "default" if failing == "interactive" else "interactive"
        sub = await puller._subscribe("m", brought)
        queue = sub._sub._pending_queue
        queued = asyncio.Event()
        deliver = queue.put_nowait

        def delivered(msg: Msg) -> None:
            deliver(msg)
            queued.set()

        queue.put_nowait = delivered  # type: ignore[method-assign]
        await js.publish(subjects.tasks("m", brought), b"task")
        # The class's task delivered to its subscription before the wait (a request of
        # its own): its wait takes it in its first step, the pass the other wait fails in.
        await provisioned_nc.publish(sub._nms, b'{"batch": 1}', reply=sub._deliver)
        await asyncio.wait_for(queued.wait(), 10)
        queue.put_nowait = deliver  # type: ignore[method-assign]
        monkeypatch.setattr(puller, "_pull", pull)
        monkeypatch.setattr(puller, "_recover", recover)
        got = await puller._first_of("m", [Turn("interactive"), Turn("default")], 5.0)
        assert [m.data for m in got] == [b"task"]
        assert recovered == ["m"]
        await got[0].ack()
    finally:
        await puller.close()
