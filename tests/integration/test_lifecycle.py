"""Instances and identities over time: removal, restarts, early cancels."""

from __future__ import annotations

import asyncio

from fleet.models.catalog import get_card
from fleet.placement import read_instances, remove
from fleet.wire import subjects
from fleet.wire.codec import encode
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import CancelTask
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    client,
    events_of,
    finished,
    hello,
    place_and_wait,
    run_task,
    submit,
    wait_node,
    wait_runner,
)


async def test_removing_an_instance_shuts_its_runner_down(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc = await client(nats_url)
    record = await place_and_wait(nc, get_card("tiny-llm"), await wait_node(nc, worker.data_dir))
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    [instance] = await read_instances(nc.jetstream())
    await remove(nc.jetstream(), instance.instance_id)
    gone = await wait_runner(watcher, "tiny-llm", ("shutdown", "shutting_down"), 30)
    assert gone.runner_id == record.runner_id
    await nc.close()


async def test_a_restarted_worker_is_the_same_node_and_serves_again(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc = await client(nats_url)
    node = await wait_node(nc, worker.data_dir)
    first = await place_and_wait(nc, get_card("tiny-llm"), node)
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    worker.stop()
    again = start_worker()  # same name: the same data dir
    assert await wait_node(nc, again.data_dir) == node
    await wait_runner(watcher, "tiny-llm", ("ready",), 60, other_than=first.runner_id)
    assert finished(await run_task(nc, hello("after-restart"))).status == "completed"
    await nc.close()


async def test_a_cancel_sent_before_the_task_is_fetched_is_honoured(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc = await client(nats_url)
    node = await wait_node(nc, worker.data_dir)
    task = hello("cancelled-early")
    cancels = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
    await cancels.put(task.task_id, encode(CancelTask(task_id=task.task_id)))
    collector = asyncio.create_task(events_of(nc, task.task_id))
    await submit(nc, task)  # queued: no instance of tiny-llm yet
    await place_and_wait(nc, get_card("tiny-llm"), node)
    result = finished(await collector)
    assert result.status == "cancelled" and result.reason is ErrorReason.CANCELLED
    await nc.close()


async def test_a_cancel_heard_only_on_its_subject_before_the_task_arrives_is_honoured(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc = await client(nats_url)
    await place_and_wait(nc, get_card("tiny-llm"), await wait_node(nc, worker.data_dir))
    task = hello("cancelled-on-the-wire")
    # No cancel record: just the message, as a plain NATS client would send it.
    await nc.publish(subjects.cancel(task.task_id), encode(CancelTask(task_id=task.task_id)))
    result = finished(await run_task(nc, task))
    assert result.status == "cancelled" and result.reason is ErrorReason.CANCELLED
    assert finished(await run_task(nc, hello("served-after"))).status == "completed"
    await nc.close()
