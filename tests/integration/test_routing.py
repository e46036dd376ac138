"""Prefix-aware dispatch with two real tiny-llm runners (real worker, nats-server, mlx-lm)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.models.catalog import get_card
from fleet.placement_replicas import place_replicas
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import decode_event, decode_model
from fleet.wire.events import TaskAccepted
from fleet.wire.prefixes import PrefixSummary
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.prefix_blocks import prompt_blocks
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    events_of,
    finished,
    run_task,
    submit,
    wait_node,
)

SYSTEMS = [f"You are assistant number {i}. Answer briefly and kindly. " * 12 for i in range(4)]


async def ready_runners(nc: Client, node_id: str, count: int, timeout: float = 120.0) -> set[str]:
    """Place `count` tiny-llm replicas on `node_id`; their runner ids once all are ready."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    await place_replicas(nc.jetstream(), get_card("tiny-llm"), count, node_id=node_id, slots=2)
    ready: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(ready) < count:
            entry = await watcher.updates(timeout=max(0.05, deadline - time.monotonic()))
            if entry is not None and entry.value:
                record = decode_model(RunnerRecord, entry.value)
                if record.model == "tiny-llm" and record.status.state == "ready":
                    ready.add(record.runner_id)
    finally:
        await watcher.stop()
    return ready


def turn(conversation: int, messages: list[ChatMessage], n: int) -> TextGeneration:
    return TextGeneration(
        task_id=f"conv{conversation}-turn{n}", model="tiny-llm", max_tokens=4,
        temperature=0.0, messages=messages,
    )


async def test_a_returning_conversation_lands_where_it_was_served(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    worker = start_worker("w1")
    nc = await client(nats_url)
    runners = await ready_runners(nc, await wait_node(nc, worker.data_dir), 2)
    chats = [
        [ChatMessage(role="system", content=system), ChatMessage(role="user", content="hi " * 40)]
        for system in SYSTEMS
    ]
    # First turns at once: two slots per runner, so they spread over both runners.
    firsts = await asyncio.gather(*(run_task(nc, turn(i, c, 1)) for i, c in enumerate(chats)))
    home = {i: finished(events).runner_id for i, events in enumerate(firsts)}
    assert set(home.values()) == runners
    # Second turns one by one: with every runner idle, only the prefix tells them apart.
    for i, messages in enumerate(chats):
        messages += [
            ChatMessage(role="assistant", content="hello"),
            ChatMessage(role="user", content="tell me more " * 10),
        ]
        result = finished(await run_task(nc, turn(i, messages, 2)))
        assert result.status == "completed"
        assert result.runner_id == home[i], f"conversation {i} left its runner"
        assert result.usage is not None and result.usage.cached_tokens > 0
    # The fleet sees the same: each runner's summary in FLEET_PREFIXES holds the blocks of
    # the conversations it served.
    summaries = await advertised(nc, runners)
    for i, messages in enumerate(chats):
        blocks = {f"{b:016x}" for b in prompt_blocks(turn(i, messages, 2))}
        assert blocks & set(summaries[home[i]].blocks)
    await nc.close()


async def advertised(
    nc: Client, runners: set[str], timeout: float = 10.0,
) -> dict[str, PrefixSummary]:
    """Each runner's latest PrefixSummary, once every one of `runners` has one with blocks
    (the worker writes them about once a second)."""
    kv = await nc.jetstream().key_value(subjects.PREFIXES_BUCKET)
    watcher = await kv.watchall()
    found: dict[str, PrefixSummary] = {}
    try:
        async with asyncio.timeout(timeout):
            while not (set(found) >= runners and all(found[r].blocks for r in runners)):
                entry = await watcher.updates(timeout=timeout)
                if entry is not None and entry.value:
                    summary = decode_model(PrefixSummary, entry.value)
                    found[summary.runner_id] = summary
    finally:
        await watcher.stop()
    return found


async def test_one_hot_prefix_spreads_over_both_runners(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    worker = start_worker("w1")
    nc = await client(nats_url)
    runners = await ready_runners(nc, await wait_node(nc, worker.data_dir), 2)
    tasks = [
        turn(i, [ChatMessage(role="system", content=SYSTEMS[0]),
                 ChatMessage(role="user", content=f"question {i}")], 1)
        for i in range(32)
    ]
    results = [finished(e) for e in await asyncio.gather(*(run_task(nc, t) for t in tasks))]
    assert all(r.status == "completed" for r in results)
    spread = Counter(r.runner_id for r in results)
    assert set(spread) == runners and min(spread.values()) >= 8, spread
    await nc.close()


async def test_tasks_held_by_a_killed_worker_complete_elsewhere_once(
    nats_url: str, start_worker: WorkerFactory,
) -> None:
    """Routing hands a task to a runner only inside the worker that holds its message, so a
    SIGKILLed worker's tasks are redelivered after AckWait and end once on the survivor."""
    env = {"FLEET_ACK_WAIT_S": "2", "OPENBLAS_NUM_THREADS": "1"}
    doomed, survivor = start_worker("a", **env), start_worker("b", **env)
    nc = await client(nats_url)
    doomed_node = await wait_node(nc, doomed.data_dir)
    survivor_node = await wait_node(nc, survivor.data_dir)
    await ready_runners(nc, doomed_node, 2)
    await ready_runners(nc, survivor_node, 1)
    tasks = [
        TextGeneration(
            task_id=f"held-{i}", model="tiny-llm", max_tokens=400, temperature=0.0,
            logit_bias={t: -100.0 for t in range(3)},  # no early end-of-sequence
            messages=[ChatMessage(role="system", content=SYSTEMS[i % 2]),
                      ChatMessage(role="user", content=f"go on {i}")],
        )
        for i in range(8)
    ]
    collectors = [asyncio.create_task(events_of(nc, t.task_id, 180)) for t in tasks]
    on_doomed = asyncio.Event()

    async def watch(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, TaskAccepted) and event.node_id == doomed_node:
            on_doomed.set()

    sub = await nc.subscribe(subjects.out("*"), cb=watch)
    for task in tasks:
        await submit(nc, task)
    await asyncio.wait_for(on_doomed.wait(), 60)  # the doomed node's runners hold tasks
    doomed.kill()
    await sub.unsubscribe()
    moved = 0
    for events in await asyncio.gather(*collectors):
        result = finished(events)  # exactly one terminal each
        assert result.status == "completed", result
        assert result.node_id == survivor_node
        assert result.usage is not None and result.usage.completion_tokens == 400
        moved += any(isinstance(e, TaskAccepted) and e.node_id == doomed_node for e in events)
    assert moved >= 1
    await nc.close()
