"""Preemption across workers (issue 25): two `fleet worker`s serving the fault engine, a runner
of 1 slot each. Worker X streams a default task (started: it may not be preempted), worker Y
prefills a batch task (no first token yet). An interactive task published then is pulled by
Y, the one worker holding a task that may yield (fleet.worker.preemption.pull_to_preempt: a
full worker pulls an interactive task only then), and ends before both: the broker carries
the preemption to the worker that can make it. Real nats-server.

The batch task is published just after X took its task, while X's wait on the batch class,
cancelled, still lingered on the server: it was delivered there and held unseen until X's
slot freed (20 s), Y idle, before X gave such strays back (fleet.worker.pulls._sweep)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished
from fleet.wire.tasks import ChatMessage, Priority, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.continuing import place_on
from tests.integration.harness import add_fault_card, client, wait_node

pytestmark = pytest.mark.timeout(300)

MODEL = "fault-llm"


def task(prefix: str, priority: Priority, prompt: str) -> TextGeneration:
    return TextGeneration(
        task_id=f"{prefix}-{secrets.token_hex(4)}", model=MODEL, max_tokens=400,
        priority=priority, messages=[ChatMessage(role="user", content=prompt)],
    )


@pytest.fixture
async def two_nodes(nats_url: str, start_worker: WorkerFactory) -> AsyncIterator[Client]:
    nc = await client(nats_url)
    for name in ("x", "y"):
        worker = start_worker(name)
        card = add_fault_card(worker.data_dir)  # before the worker reads its cards
        await place_on(nc, card, await wait_node(nc, worker.data_dir), slots=1)
    yield nc
    await nc.close()


async def test_an_interactive_task_preempts_a_prefilling_batch_task_on_the_other_worker(
    two_nodes: Client,
) -> None:
    nc = two_nodes
    js = nc.jetstream()
    chat_long = task("default", "default", "tokens:200 delay_ms:100")  # 20 s, streaming
    line = task("line", "batch", "tokens:5 first_token_ms:15000 delay_ms:10")
    chat = task("chat", "interactive", "tokens:3 delay_ms:10")
    events: dict[str, list[OutputEvent]] = {t.task_id: [] for t in (chat_long, line, chat)}
    accepted = {t.task_id: asyncio.Event() for t in (chat_long, line)}
    finished: list[str] = []
    all_done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            if event.task_id not in events:
                continue
            events[event.task_id].append(event)
            if isinstance(event, TaskAccepted) and event.task_id in accepted:
                accepted[event.task_id].set()
            if isinstance(event, TaskFinished):
                finished.append(event.task_id)
                if len(finished) == 3:
                    all_done.set()

    sub = await nc.subscribe("fleet.out.*", cb=on_event)
    try:
        await js_publish(js, subjects.tasks(MODEL), chat_long, msg_id=chat_long.task_id)
        await asyncio.wait_for(accepted[chat_long.task_id].wait(), 60)
        await js_publish(js, subjects.tasks(MODEL, "batch"), line, msg_id=line.task_id)
        await asyncio.wait_for(accepted[line.task_id].wait(), 60)  # the other node: prefilling
        await js_publish(js, subjects.tasks(MODEL, "interactive"), chat, msg_id=chat.task_id)
        await asyncio.wait_for(all_done.wait(), 180)
        info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable(MODEL, "batch"))
    finally:
        await sub.unsubscribe()

    def node_of(task_id: str) -> str:
        return next(e.node_id for e in events[task_id] if isinstance(e, TaskAccepted))

    assert node_of(chat_long.task_id) != node_of(line.task_id)
    assert node_of(chat.task_id) == node_of(line.task_id)  # where a task could yield
    assert finished[0] == chat.task_id, finished  # before both the stream and the prefill
    line_ends = [e for e in events[line.task_id] if isinstance(e, TaskFinished)]
    assert [e.status for e in line_ends] == ["completed"]  # requeued there, not failed
    assert info.num_redelivered == 0, info
