"""Preemption against nats-server and one `fleet worker` (fault engine, a runner of 1 slot):
a batch task still prefilling (no token yet) yields its slot to an interactive task published
meanwhile; the interactive one ends first, and the batch one then completes exactly once with
every token, its message never given back (fleet.worker.preemption)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import pytest
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, Priority, TextGeneration
from tests.integration.harness import WorkerProcess, add_fault_card, fault_worker_stack, serving

pytestmark = pytest.mark.timeout(240)

MODEL = "fault-llm"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WorkerProcess]]:
    root = tmp_path_factory.mktemp("preemption")
    with fault_worker_stack(root, MODEL) as (url, worker):
        yield url, worker


def task(prefix: str, priority: Priority, prompt: str) -> TextGeneration:
    return TextGeneration(
        task_id=f"{prefix}-{secrets.token_hex(4)}", model=MODEL, max_tokens=64,
        priority=priority, messages=[ChatMessage(role="user", content=prompt)],
    )


async def test_a_prefilling_batch_task_yields_to_an_interactive_one(
    stack: tuple[str, WorkerProcess],
) -> None:
    url, worker = stack
    nc, _ = await serving(url, worker, add_fault_card(worker.data_dir, MODEL), slots=1)
    js = nc.jetstream()
    # The batch task sends nothing for 8 s after each admission (a long prefill).
    line = task("line", "batch", "tokens:5 first_token_ms:8000 delay_ms:10")
    chat = task("chat", "interactive", "tokens:3 delay_ms:10")
    events: dict[str, list[OutputEvent]] = {line.task_id: [], chat.task_id: []}
    finished: list[str] = []
    line_accepted = asyncio.Event()
    both_done = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            if event.task_id not in events:
                continue
            events[event.task_id].append(event)
            if isinstance(event, TaskAccepted) and event.task_id == line.task_id:
                line_accepted.set()
            if isinstance(event, TaskFinished):
                finished.append(event.task_id)
                if len(finished) >= 2:
                    both_done.set()

    sub = await nc.subscribe("fleet.out.*", cb=on_event)
    try:
        await js_publish(js, subjects.tasks(MODEL, "batch"), line, msg_id=line.task_id)
        await asyncio.wait_for(line_accepted.wait(), 60)  # on the only slot, prefilling
        await js_publish(js, subjects.tasks(MODEL, "interactive"), chat, msg_id=chat.task_id)
        await asyncio.wait_for(both_done.wait(), 120)
        info = await js.consumer_info(subjects.TASKS_STREAM, subjects.durable(MODEL, "batch"))
    finally:
        await sub.unsubscribe()
        await nc.close()
    assert finished == [chat.task_id, line.task_id], finished  # interactive first
    ends = [e for e in events[line.task_id] if isinstance(e, TaskFinished)]
    assert [e.status for e in ends] == ["completed"], ends  # once, not failed or cancelled
    indexes = sorted(i for e in events[line.task_id] if isinstance(e, TokenChunk)
                     for i in range(e.index, e.index + len(e.ids)))
    assert indexes == list(range(5)), events[line.task_id]  # every token once
    # Requeued on the worker, not given back: no delivery was spent on the preemption.
    assert info.num_redelivered == 0, info
