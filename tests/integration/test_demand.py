"""Placement on demand, with real workers: a task for a model that nobody serves places it."""

from __future__ import annotations

import asyncio

from fleet.placement import read_instances
from fleet.placement_rules import auto_instance_id
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    events_of,
    finished,
    hello,
    run_task,
    submit,
    wait_node,
)


async def test_a_task_for_a_model_nobody_serves_places_it_and_completes(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker(FLEET_AUTO_PLACE="1")
    nc = await client(nats_url)
    node = await wait_node(nc, worker.data_dir)
    assert await read_instances(nc.jetstream()) == []
    assert finished(await run_task(nc, hello("demand-live"), timeout=90)).status == "completed"
    [instance] = await read_instances(nc.jetstream())
    assert instance.instance_id == auto_instance_id("tiny-llm")
    assert [shard.node_id for shard in instance.shards] == [node]
    await nc.close()


async def test_tasks_queued_before_the_fleet_starts_place_one_instance_for_all(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    tasks = [hello(f"queued-{i}") for i in range(3)]
    for task in tasks:
        await submit(nc, task)
    # Two workers see the same demand (sweep and triage); the compare-and-set lets one place.
    start_worker("w1", FLEET_AUTO_PLACE="1")
    start_worker("w2", FLEET_AUTO_PLACE="1")
    outcomes = await asyncio.gather(*(events_of(nc, task.task_id, 90) for task in tasks))
    assert [finished(events).status for events in outcomes] == ["completed"] * 3
    assert [i.instance_id for i in await read_instances(nc.jetstream())] == ["tiny-llm-auto"]
    await nc.close()
