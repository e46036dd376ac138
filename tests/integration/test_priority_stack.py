"""Priorities against nats-server and one `fleet worker` (fault engine, a runner of 2 slots):
batch work runs only in the slack (one slot of two), so an interactive task published while a
job runs starts at once and ends before the job's next line; the lines still all run."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Iterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_event
from fleet.wire.events import TaskAccepted, TaskFinished
from fleet.wire.tasks import ChatMessage, Priority, TextGeneration
from tests.integration.harness import WorkerProcess, add_fault_card, fault_worker_stack, serving

pytestmark = pytest.mark.timeout(240)

MODEL = "fault-llm"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WorkerProcess]]:
    root = tmp_path_factory.mktemp("priority")
    with fault_worker_stack(root, MODEL) as (url, worker):
        yield url, worker


def task(prefix: str, priority: Priority, prompt: str) -> TextGeneration:
    return TextGeneration(
        task_id=f"{prefix}-{secrets.token_hex(4)}", model=MODEL, max_tokens=64,
        priority=priority, messages=[ChatMessage(role="user", content=prompt)],
    )


async def publish(nc: Client, t: TextGeneration) -> None:
    await js_publish(nc.jetstream(), subjects.tasks(t.model, t.priority), t, msg_id=t.task_id)


async def test_an_interactive_task_overtakes_a_batch_job(
    stack: tuple[str, WorkerProcess],
) -> None:
    url, worker = stack
    nc, _ = await serving(url, worker, add_fault_card(worker.data_dir, MODEL), slots=2)
    order: list[tuple[str, str]] = []  # (task id, "accepted" | "finished"), as seen
    first_line_runs = asyncio.Event()
    all_done = asyncio.Event()
    lines = [task("line", "batch", "tokens:20 tokens_per_s:10") for _ in range(3)]  # ~2 s
    chat = task("chat", "interactive", "tokens:2")

    async def on_event(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted | TaskFinished):
            order.append((event.task_id, "accepted" if isinstance(event, TaskAccepted)
                          else "finished"))
            first_line_runs.set()
            if sum(kind == "finished" for _, kind in order) == len(lines) + 1:
                all_done.set()

    sub = await nc.subscribe("fleet.out.*", cb=on_event)
    try:
        for line in lines:
            await publish(nc, line)
        await asyncio.wait_for(first_line_runs.wait(), 60)
        await publish(nc, chat)
        await asyncio.wait_for(all_done.wait(), 120)
    finally:
        await sub.unsubscribe()
        await nc.close()
    finished = [task_id for task_id, kind in order if kind == "finished"]
    assert finished.index(chat.task_id) <= 1, order  # before the job's second line ended
    for earlier, later in itertools.pairwise(lines):  # one line at a time
        assert order.index((earlier.task_id, "finished")) < order.index(
            (later.task_id, "accepted")), order
