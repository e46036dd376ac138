"""A worker that dies: JetStream redelivers its task, and the task still ends exactly once.

These drive the fault-injection engine (a plumbing double): what is under test is the worker's
redelivery handling, not a model.
"""

from __future__ import annotations

import asyncio
from functools import partial

from nats.aio.msg import Msg

from fleet.wire import subjects
from fleet.wire.events import ErrorReason, TaskAccepted, TokenChunk, token_indexes
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    add_fault_card,
    client,
    events_of,
    finished,
    place_and_wait,
    submit,
    until_queue_empty,
    wait_node,
)

FAST_REDELIVERY = {"FLEET_ACK_WAIT_S": "2"}


def fault_task(task_id: str, knobs: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content=knobs)],
    )


async def _on_type(kind: str, event: asyncio.Event, msg: Msg) -> None:
    if f'"type":"{kind}"'.encode() in msg.data:
        event.set()


async def _first(nc: object, task_id: str, kind: str) -> asyncio.Event:
    seen = asyncio.Event()
    await nc.subscribe(subjects.out(task_id), cb=partial(_on_type, kind, seen))  # type: ignore[attr-defined]
    return seen


async def test_worker_killed_before_output_lets_a_second_worker_complete_the_task(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    first = start_worker("a", **FAST_REDELIVERY)
    card = add_fault_card(first.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, first.data_dir))
    task = fault_task("survives", "tokens:3 delay_ms:4000")
    accepted = await _first(nc, task.task_id, "task_accepted")
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await asyncio.wait_for(accepted.wait(), 30)
    first.kill()  # before its first token (4 s away)

    second = start_worker("b", **FAST_REDELIVERY)
    add_fault_card(second.data_dir)
    await place_and_wait(nc, card, await wait_node(nc, second.data_dir))
    events = await collector
    assert finished(events).status == "completed"
    tokens = token_indexes(events)
    assert tokens == [0, 1, 2]  # never twice
    deliveries = [e.delivery for e in events if isinstance(e, TaskAccepted)]
    assert deliveries[0] == 1 and deliveries[-1] >= 2
    await nc.close()


async def test_worker_killed_after_output_started_ends_the_task_worker_lost_past_its_limit(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    first = start_worker("a", **FAST_REDELIVERY)
    card = add_fault_card(first.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, first.data_dir))
    task = fault_task("half-done", "tokens:200 delay_ms:200").model_copy(
        update={"max_continuations": 0}
    )
    token = await _first(nc, task.task_id, "token")
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await asyncio.wait_for(token.wait(), 30)
    first.kill()

    second = start_worker("b", **FAST_REDELIVERY)
    add_fault_card(second.data_dir)
    await place_and_wait(nc, card, await wait_node(nc, second.data_dir))
    result = finished(await collector)
    assert result.status == "failed" and result.reason is ErrorReason.WORKER_LOST
    await nc.close()


async def test_worker_killed_after_output_started_is_continued_from_the_next_token(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    first = start_worker("a", **FAST_REDELIVERY)
    card = add_fault_card(first.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, first.data_dir))
    task = fault_task("continued", "tokens:12 delay_ms:300")
    token = await _first(nc, task.task_id, "token")
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await asyncio.wait_for(token.wait(), 30)
    first.kill()

    second = start_worker("b", **FAST_REDELIVERY)
    add_fault_card(second.data_dir)
    await place_and_wait(nc, card, await wait_node(nc, second.data_dir))
    events = await collector
    result = finished(events)
    assert result.status == "completed" and result.usage is not None
    tokens = [e for e in events if isinstance(e, TokenChunk)]
    assert token_indexes(tokens) == list(range(12))  # no index repeated, none missing
    assert "".join(t.text for t in tokens) == "".join(f" t{i}" for i in range(12))
    assert result.usage.completion_tokens == 12
    accepted = [e for e in events if isinstance(e, TaskAccepted)]
    assert accepted[0].continued_from == 0 and accepted[-1].continued_from > 0
    await nc.close()


async def test_a_task_past_max_deliver_is_dead_lettered_and_finished_failed(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    env = {**FAST_REDELIVERY, "FLEET_MAX_DELIVER": "1"}
    first = start_worker("a", **env)
    card = add_fault_card(first.data_dir)
    nc = await client(nats_url)
    await place_and_wait(nc, card, await wait_node(nc, first.data_dir))
    task = fault_task("doomed", "tokens:3 delay_ms:5000")
    accepted = await _first(nc, task.task_id, "task_accepted")
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)
    await asyncio.wait_for(accepted.wait(), 30)
    first.kill()
    second = start_worker("b", **env)
    add_fault_card(second.data_dir)
    # The server checks MaxDeliver when it would redeliver, i.e. when someone pulls again.
    await place_and_wait(nc, card, await wait_node(nc, second.data_dir))

    result = finished(await collector)
    assert result.status == "failed" and result.reason is ErrorReason.MAX_DELIVERIES
    js = nc.jetstream()
    dead = await js.get_last_msg(subjects.DEAD_LETTERS_STREAM, subjects.dead_letter("fault-llm"))
    assert b'"task_id":"doomed"' in (dead.data or b"")
    await until_queue_empty(js)
    await nc.close()
