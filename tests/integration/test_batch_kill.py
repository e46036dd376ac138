"""A fetched batch's claims, look-ups and confirmed acks go out pipelined (fleet.bus.pipelined,
issue 23): a worker SIGKILLed with a batch of tasks in every stage (being claimed, waiting for
a slot, streaming, ending, acked) loses none of them, and each ends in exactly one terminal
state, whole, after a second worker takes the rest over. A real nats-server, two real workers
and the fault engine (a plumbing double)."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from fleet.bus.task_log import ordered
from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import OutputEvent, TaskFinished, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import client, submit, until_queue_empty
from tests.integration.killing import fault_workers

FAST = {"FLEET_ACK_WAIT_S": "2"}  # the dead worker's tasks are redelivered 2 s on
TASKS = 48
TOKENS = 4
TIMEOUT_S = 240.0


def batch_task(n: int) -> TextGeneration:
    """Paced so that they end one after another (task n in about 0.1 + 0.1 n s)."""
    return TextGeneration(
        task_id=f"batch-{n}", model="fault-llm", max_tokens=100,
        messages=[ChatMessage(role="user", content=f"tokens:{TOKENS} delay_ms:{25 + 25 * n}")],
    )


async def test_a_worker_killed_mid_batch_loses_no_task_and_ends_each_once(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    start = fault_workers(nc, start_worker, **FAST)
    first, _ = await start("a")
    events: dict[str, list[OutputEvent]] = {}
    terminals: set[str] = set()
    some_ended, all_ended = asyncio.Event(), asyncio.Event()

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            events.setdefault(event.task_id, []).append(event)
            if isinstance(event, TaskFinished):
                terminals.add(event.task_id)
                if len(terminals) >= TASKS // 4:
                    some_ended.set()
                if len(terminals) == TASKS:
                    all_ended.set()

    # Every stored event of every task, in stored order (terminals included).
    sub = await nc.jetstream().subscribe(
        subjects.out("*"), stream=subjects.OUT_STREAM, ordered_consumer=True, cb=on_event)
    try:
        await asyncio.gather(*(submit(nc, batch_task(n)) for n in range(TASKS)))
        await asyncio.wait_for(some_ended.wait(), TIMEOUT_S)
        ended_before = len(terminals)
        first.kill()  # a quarter ended (and acked, or not yet), the rest mid-answer or queued
        await start("b")
        await asyncio.wait_for(all_ended.wait(), TIMEOUT_S)
        await until_queue_empty(nc.jetstream(), TIMEOUT_S)  # every message settled
    finally:
        await sub.unsubscribe()
    assert sorted(terminals) == sorted(f"batch-{n}" for n in range(TASKS))
    assert ended_before < TASKS  # the kill landed mid-batch: the second worker ended the rest
    for task_id, found in events.items():
        ends = [e for e in found if isinstance(e, TaskFinished)]
        assert len(ends) == 1, f"{task_id}: {len(ends)} terminals"
        assert ends[0].status == "completed", f"{task_id}: {ends[0]}"
        # What a reader sees (index order, superseded copies dropped): whole, none twice.
        assert token_indexes(ordered(found)) == list(range(TOKENS)), task_id
    await nc.close()
