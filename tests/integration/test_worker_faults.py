"""The worker under faults of its own children and of its broker objects: a runner dying under
a dispatch, a task waiting for a slot past AckWait, its durable consumer deleted, a child
loop that ends. Real nats-server, real runner subprocesses (the fault engine: plumbing only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from fleet.bus.connect import js_publish
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.cluster import ModelCard
from fleet.wire.events import ErrorReason, TaskAccepted, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.main import Worker
from fleet.worker.state import PendingTask, TaskQueued
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    add_fault_card,
    client,
    events_of,
    finished,
    place_and_wait,
    run_task,
    submit,
    wait_node,
)

ACK_WAIT_S = 2.0


def fault_task(task_id: str, knobs: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=knobs)],
    )


InProcess = tuple[Worker, Client, ModelCard]


@pytest.fixture
async def in_process(nats_url: str, tmp_path: Path) -> AsyncIterator[InProcess]:
    """A Worker in this process (so a test can reach its runners), serving fault-llm."""
    data_dir = tmp_path / "w"
    card = add_fault_card(data_dir)
    settings = Settings(nats_url=nats_url, data_dir=data_dir, auto_place=False, ack_wait_s=5.0)
    worker = Worker(settings)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 60)
    nc = await client(nats_url)
    await place_and_wait(nc, card, worker.cluster.node_id, slots=1)
    yield worker, nc, card
    worker.stop()
    await asyncio.wait_for(running, 60)
    await nc.close()


async def test_a_dispatch_to_a_runner_that_just_died_ends_runner_crashed(
    in_process: InProcess,
) -> None:
    """The runner is killed and, before its exit is seen, a task is dispatched to it: the
    task is in flight in WorkerState, and the runner's exit ends it runner_crashed."""
    worker, nc, _ = in_process
    [runner_id] = list(worker.runners.processes)
    process = worker.runners.processes[runner_id]
    task = fault_task("late", "tokens:3")
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout=30))
    started = time.monotonic()
    process.kill_now()
    # No await between the kill and the queueing: the loop sees the task before the exit.
    worker.inbox.put_nowait(TaskQueued(PendingTask(task=task, received_at=time.time(), inputs={})))
    result = finished(await collector)
    assert (result.status, result.reason) == ("failed", ErrorReason.RUNNER_CRASHED)
    assert result.runner_id == runner_id and "killed by SIGKILL" in (result.message or "")
    assert time.monotonic() - started < 10
    assert "late" not in {t for r in worker.state.runners.values() for t in r.in_flight}


async def test_a_child_loop_that_ends_is_restarted_and_logged(
    in_process: InProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancel listener's subscription is dropped under it: the supervisor logs it and
    starts it again, and a cancel for a running task still lands."""
    worker, nc, _ = in_process
    listener = next(t for t in asyncio.all_tasks() if t.get_name() == "worker/cancel listener")
    sub = worker.feeds.cancel_sub
    assert sub is not None
    with caplog.at_level(logging.ERROR, logger="fleet.aio"):
        await sub.unsubscribe()
        async with asyncio.timeout(10):
            while worker.feeds.cancel_sub in (None, sub):  # restarted, subscribed anew
                await asyncio.sleep(0.05)  # polling the listener's state, bounded by the timeout
    await worker.nc.flush()  # the new SUB is at the server before anyone cancels
    assert worker.owner.restarts["cancel listener"] == 1
    assert not listener.done()
    assert "cancel listener returned" in caplog.text
    task = fault_task("to-cancel", "tokens:1000 delay_ms:50")
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout=30))
    accepted = asyncio.Event()

    async def on_event(msg: object) -> None:
        if b'"type":"token"' in msg.data:  # type: ignore[attr-defined]
            accepted.set()

    sub2 = await nc.subscribe(subjects.out(task.task_id), cb=on_event)
    await submit(nc, task)
    await asyncio.wait_for(accepted.wait(), 30)
    await nc.publish(subjects.cancel(task.task_id), b"")
    result = finished(await collector)
    assert result.status == "cancelled"
    await sub2.unsubscribe()


async def test_a_task_waiting_for_a_slot_past_ack_wait_is_delivered_once(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """One slot. A batch task still prefilling yields it to an interactive one (preemption) and
    waits on the worker, its message held, while the interactive task streams for longer than
    AckWait (2 s). Its in_progress beats keep it: a second consumer on the batch durable gets
    nothing, and it runs once, delivery 1, nothing redelivered.

    (This test once made the wait with a runner crash and a pull racing the runner's exit:
    whether the pull came first depended on the load, so the task was sometimes never held.)"""
    worker = start_worker("w", FLEET_ACK_WAIT_S=str(ACK_WAIT_S), FLEET_SLOTS="1")
    card = add_fault_card(worker.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, worker.data_dir), slots=1)
    line = fault_task("line", "tokens:3 first_token_ms:8000 delay_ms:10")
    line = line.model_copy(update={"priority": "batch"})
    chat = fault_task("chat", f"tokens:{int(4 * ACK_WAIT_S / 0.05)} delay_ms:50")  # ~4 AckWaits
    chat = chat.model_copy(update={"priority": "interactive"})
    line_events = asyncio.create_task(events_of(nc, line.task_id, timeout=120))
    chat_events = asyncio.create_task(events_of(nc, chat.task_id, timeout=120))
    js = nc.jetstream()
    await js_publish(js, subjects.tasks("fault-llm", "batch"), line, msg_id=line.task_id)
    durable = subjects.durable("fault-llm", "batch")
    async with asyncio.timeout(30):  # until the worker holds the line (delivered, not acked)
        while True:
            try:
                info = await js.consumer_info(subjects.TASKS_STREAM, durable)
            except nats.js.errors.NotFoundError:
                pass  # the worker makes a class's durable at its first pull of that class
            else:
                if info.num_pending == 0 and info.num_ack_pending == 1:
                    break
            await asyncio.sleep(0.1)  # polling the consumer's state, bounded
    await js_publish(js, subjects.tasks("fault-llm", "interactive"), chat, msg_id=chat.task_id)
    rival = await js.pull_subscribe_bind(durable, stream=subjects.TASKS_STREAM)
    with pytest.raises(nats.errors.TimeoutError):
        await rival.fetch(1, timeout=3 * ACK_WAIT_S)  # a redelivery would land here
    await rival.unsubscribe()
    chat_done, events = finished(await chat_events), await line_events
    assert chat_done.status == "completed"
    assert finished(events).status == "completed"
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert accepted and {e.delivery for e in accepted} == {1}, accepted
    # It did wait on the worker past AckWait: its first token came after the chat's end.
    first_token = min(e.at for e in events if isinstance(e, TokenChunk))
    assert first_token - accepted[0].at > 2 * ACK_WAIT_S, (first_token, accepted)
    assert first_token >= chat_done.at
    info = await js.consumer_info(subjects.TASKS_STREAM, durable)
    assert info.num_redelivered == 0
    await nc.close()


async def test_a_consumer_deleted_under_a_running_worker_is_recreated(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker("w")
    card = add_fault_card(worker.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, worker.data_dir))
    assert finished(await run_task(nc, fault_task("before", "tokens:2"))).status == "completed"
    js = nc.jetstream()
    assert await js.delete_consumer(subjects.TASKS_STREAM, subjects.durable("fault-llm"))
    events = await run_task(nc, fault_task("after", "tokens:2"), timeout=60)
    assert finished(events).status == "completed"
    assert worker.log().count("is gone (deleted under this worker): recreating it") == 1
    await nc.close()


async def test_a_worker_stopped_mid_task_gives_it_back_and_never_says_cancelled(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """SIGTERM while a task streams: its runner stops it, but nobody cancelled it - no
    `cancelled` terminal is written; the message is nak'ed at once (not left to AckWait), and
    the next worker ends it worker_lost (its output had begun)."""
    first = start_worker("a")
    card = add_fault_card(first.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, first.data_dir))
    # Not continued (max_continuations 0): continuation has tests/integration/test_continuation.py
    task = fault_task("interrupted", "tokens:100000 delay_ms:20").model_copy(
        update={"max_continuations": 0}
    )
    token = asyncio.Event()

    async def on_event(msg: object) -> None:
        if b'"type":"token"' in msg.data:  # type: ignore[attr-defined]
            token.set()

    sub = await nc.subscribe(subjects.out(task.task_id), cb=on_event)
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout=120))
    await submit(nc, task)
    await asyncio.wait_for(token.wait(), 30)
    await sub.unsubscribe()
    await asyncio.to_thread(first.stop)
    assert first.process is not None and first.process.returncode == 0
    js = nc.jetstream()
    rival = await js.pull_subscribe_bind(
        subjects.durable("fault-llm"), stream=subjects.TASKS_STREAM
    )
    [again] = await rival.fetch(1, timeout=10)  # nak'ed on the way out: not held to AckWait
    assert again.metadata.num_delivered == 2
    await again.nak()
    await rival.unsubscribe()
    second = start_worker("b")
    add_fault_card(second.data_dir)
    await place_and_wait(nc, card, await wait_node(nc, second.data_dir))
    events = await collector
    result = finished(events)
    assert (result.status, result.reason) == ("failed", ErrorReason.WORKER_LOST)
    assert not [e for e in events if getattr(e, "status", None) == "cancelled"]
    await nc.close()
