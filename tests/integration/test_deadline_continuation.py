"""A task with a deadline whose worker dies mid-answer (issue 25, the TTL-versus-continuation
corner), against nats-server and two `fleet worker`s (fault engine, AckWait 2 s). The task is
published as the gateway publishes: a sentinel at its deadline, and a message TTL.

A deadline is when a task must have started (fleet.bus.deadlines): a continuation that would
start after it is not run, and the task ends `expired` with its streamed tokens kept; one that
starts before it runs to the end, past the deadline, as a first attempt would. Neither may
lose the task: before the message outlived its deadline by TAKEOVER_GRACE_S, the broker
dropped it at the deadline, so a worker dying after it left the task without a terminal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.client import Client

from fleet.bus.connect import js_publish
from fleet.bus.deadlines import publish_deadline, task_ttl_header
from fleet.wire import subjects
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import ENV, Live, place_on
from tests.integration.harness import WorkerProcess, add_fault_card, client, events_of, wait_node

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def two(nats_url: str, start_worker: WorkerFactory) -> AsyncIterator[
        tuple[Client, dict[str, WorkerProcess], Live]]:
    nc = await client(nats_url)
    nodes: dict[str, WorkerProcess] = {}
    for name in ("a", "b"):
        worker = start_worker(name, **ENV)
        card = add_fault_card(worker.data_dir)  # before the worker reads its cards
        node = await wait_node(nc, worker.data_dir)
        nodes[node] = worker
        await place_on(nc, card, node)
    live = Live()
    await nc.subscribe("fleet.out.>", cb=live.on_msg)
    yield nc, nodes, live
    await nc.close()


async def publish(nc: Client, task_id: str, deadline_s: float, knobs: str) -> TextGeneration:
    """As the gateway publishes a task (fleet.gateway.backend.publish_task)."""
    task = TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        deadline=datetime.now(UTC) + timedelta(seconds=deadline_s),
        messages=[ChatMessage(role="user", content=knobs)])
    js = nc.jetstream()
    await js_publish(js, subjects.tasks(task.model), task, msg_id=task.task_id,
                     extra_headers=task_ttl_header(task.deadline, time.time()))
    await publish_deadline(js, task)
    return task


def tokens_of(events: list) -> list[int]:  # type: ignore[type-arg]
    return [i for e in events if isinstance(e, TokenChunk)
            for i in range(e.index, e.index + e.count)]


async def test_a_worker_lost_after_the_deadline_ends_the_task_expired_keeping_its_output(
    two: tuple[Client, dict[str, WorkerProcess], Live],
) -> None:
    nc, nodes, live = two
    task = await publish(nc, "late-seam", 4.0, "tokens:300 delay_ms:100")
    await live.until(lambda: live.tokens(task.task_id) >= 3, 120)
    assert task.deadline is not None
    # What is awaited here is the deadline itself (a wall-clock time), not another process.
    await asyncio.sleep(max(0.0, task.deadline.timestamp() - time.time()) + 0.5)
    victim = live.node_running(task.task_id)
    assert victim is not None and not live.done(task.task_id), "make the task longer"
    nodes[victim].kill()
    events = await events_of(nc, task.task_id, timeout=120)
    finished = events[-1]
    assert isinstance(finished, TaskFinished)
    assert (finished.status, finished.reason) == ("expired", "deadline"), finished
    assert "while it was being continued" in (finished.message or "")
    streamed = tokens_of(events)
    assert len(streamed) >= 3 and streamed == list(range(len(streamed)))  # kept, clean
    assert f"its {len(streamed)} streamed tokens are kept" in (finished.message or "")
    assert [e.attempt for e in events if isinstance(e, TaskAccepted)] == [0]  # not run again


async def test_a_continuation_that_starts_in_time_runs_past_the_deadline_to_the_end(
    two: tuple[Client, dict[str, WorkerProcess], Live],
) -> None:
    nc, nodes, live = two
    task = await publish(nc, "early-seam", 20.0, "tokens:80 delay_ms:400")
    await live.until(lambda: live.tokens(task.task_id) >= 3, 120)
    victim = live.node_running(task.task_id)
    assert victim is not None and not live.done(task.task_id)
    nodes[victim].kill()
    events = await events_of(nc, task.task_id, timeout=180)
    finished = events[-1]
    assert isinstance(finished, TaskFinished)
    assert finished.status == "completed", (finished.reason, finished.message)
    assert tokens_of(events) == list(range(80))
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert [e.attempt for e in accepted] == [0, 1]
    assert task.deadline is not None and time.time() > task.deadline.timestamp()
