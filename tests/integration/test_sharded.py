"""A model over two nodes: two `fleet worker` processes, each with its own data dir, against
one real nats-server; the instance's two shards form a ring over mx.distributed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client

from fleet.models.catalog import get_card
from fleet.placement import place, remove
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord
from fleet.wire.codec import decode_model
from fleet.wire.events import TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    finished,
    run_task,
    text_of,
    wait_node,
)


def paris(task_id: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="smollm2-135m", max_tokens=12, temperature=0.0,
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
    )


async def ready_ranks(nc: Client, instance: Instance, timeout: float = 240.0) -> None:
    """Until every rank's runner of `instance` has reported ready (one KV watch)."""
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    ranks: set[int] = set()
    try:
        async with asyncio.timeout(timeout):
            while ranks != set(range(len(instance.shards))):
                entry = await watcher.updates(timeout=timeout)
                if entry is None or not entry.value:
                    continue
                record = decode_model(RunnerRecord, entry.value)
                if record.instance_id == instance.instance_id and record.status.state == "ready":
                    ranks.add(record.rank)
    finally:
        await watcher.stop()


async def test_smollm2_over_two_nodes_answers_with_the_unsharded_tokens(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    first = start_worker("w1", models=models)
    second = start_worker("w2", models=models)
    nc = await client(nats_url)
    node_1 = await wait_node(nc, first.data_dir)
    await wait_node(nc, second.data_dir)
    js = nc.jetstream()
    card = get_card("smollm2-135m")

    alone = await place(js, card, node_id=node_1, slots=2)
    await ready_ranks(nc, alone)
    unsharded = await run_task(nc, paris("alone-1"))
    await remove(js, alone.instance_id)

    sharded = await place(js, card, slots=2, shards=2)
    assert [(s.rank, s.start_layer) for s in sharded.shards] == [(0, 0), (1, 15)]
    await ready_ranks(nc, sharded)
    events = await run_task(nc, paris("sharded-1"))
    assert finished(events).status == "completed"
    assert "Paris" in text_of(events)
    tokens = [e.token_id for e in events if isinstance(e, TokenChunk)]
    assert tokens == [e.token_id for e in unsharded if isinstance(e, TokenChunk)]
    accepted = [e for e in events if e.type == "task_accepted"]
    assert [e.node_id for e in accepted] == [sharded.shards[0].node_id]  # rank 0's worker
    await nc.close()
