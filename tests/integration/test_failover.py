"""Node loss: a node's heartbeat expires, its instances move to a live node, tasks go on."""

from __future__ import annotations

from fleet.models.catalog import get_card
from fleet.placement import read_instances
from fleet.wire import subjects
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    finished,
    place_and_wait,
    run_task,
    wait_node,
    wait_runner,
)


async def test_instances_of_a_dead_node_move_to_a_live_one(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    doomed, survivor = start_worker("a"), start_worker("b")
    nc = await client(nats_url)
    doomed_node = await wait_node(nc, doomed.data_dir)
    survivor_node = await wait_node(nc, survivor.data_dir)
    first = await place_and_wait(nc, get_card("tiny-llm"), doomed_node)
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()

    doomed.kill()  # its FLEET_NODES key expires after the bucket TTL (15 s)
    record = await wait_runner(watcher, "tiny-llm", ("ready",), 60, other_than=first.runner_id)
    assert record.node_id == survivor_node
    assert [s.node_id for i in await read_instances(nc.jetstream()) for s in i.shards] == [
        survivor_node
    ]
    task = TextGeneration(
        task_id="after-failover", model="tiny-llm", max_tokens=4, temperature=0.0,
        messages=[ChatMessage(role="user", content="still there?")],
    )
    result = finished(await run_task(nc, task))
    assert result.status == "completed" and result.node_id == survivor_node
    await nc.close()
