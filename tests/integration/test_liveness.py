"""Liveness on evidence: a broker outage long enough for every heartbeat key to expire moves
nothing and stops no runner; a placement stranded on a node that died alone is healed by a
worker started later. Real nats-server, real `fleet worker` processes, tiny-llm."""

from __future__ import annotations

import asyncio
import contextlib
import time
from functools import partial

from nats.aio.msg import Msg

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from fleet.placement import moved, read_instances
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord, ShardAssignment
from fleet.wire.codec import decode_model, encode
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.failover import SWEEP_S
from fleet.worker.heartbeat import NODE_TTL_S
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    add_fault_card,
    client,
    events_of,
    finished,
    hello,
    place_and_wait,
    run_task,
    submit,
    wait_node,
)

# Longer than FLEET_NODES' max age: when the server comes back, every heartbeat it holds
# is older than the TTL and expires at once, as after a long loss of the KV leader.
OUTAGE_S = NODE_TTL_S + 3.0
# After both workers beat again: a full TTL plus two sweeps in which nothing may move.
WATCH_S = NODE_TTL_S + 2 * SWEEP_S + 2.0


async def test_an_outage_longer_than_the_heartbeat_ttl_moves_nothing_and_stops_no_runner(
    nats_server: EmbeddedNats, nats_url: str, start_worker: WorkerFactory
) -> None:
    a, b = start_worker("a"), start_worker("b")
    nc = await client(nats_url)
    node_a, node_b = await wait_node(nc, a.data_dir), await wait_node(nc, b.data_dir)
    card = get_card("tiny-llm")
    ready = [await place_and_wait(nc, card, node_a, slots=2),
             await place_and_wait(nc, card, node_b, slots=2)]
    before = {i.instance_id: i for i in await read_instances(nc.jetstream())}
    await nc.close()

    nats_server.stop()  # the KV (and everything else) is unreachable for OUTAGE_S
    await asyncio.sleep(OUTAGE_S)  # the fault's duration, not synchronisation
    again = EmbeddedNats(nats_server.store_dir, port=nats_server.port,
                         log_file=nats_server.log_file)
    again.start()
    try:
        nc = await client(nats_url)
        js = nc.jetstream()
        await wait_node(nc, a.data_dir, timeout=60)
        await wait_node(nc, b.data_dir, timeout=60)
        changes = await _instance_changes(nc, WATCH_S)
        assert changes == [], f"instances changed after the outage: {changes}"
        after = {i.instance_id: i for i in await read_instances(js)}
        assert after == before
        # The same runners, still ready: none was stopped and restarted.
        runners = await js.key_value(subjects.RUNNERS_BUCKET)
        for record in ready:
            entry = await runners.get(record.runner_id)
            assert entry.value, f"runner {record.runner_id} has no record"
            assert decode_model(RunnerRecord, entry.value).status.state == "ready"
        for i in range(4):
            result = finished(await run_task(nc, hello(f"after-outage-{i}"), timeout=60))
            assert result.status == "completed", result
        for worker in (a, b):
            log = worker.log()
            assert "left: moved" not in log and "re-placing" not in log, log[-3000:]
            assert worker.process is not None and worker.process.poll() is None
        await nc.close()
    finally:
        again.stop()


async def _instance_changes(nc: object, window_s: float) -> list[str]:
    """Every change to FLEET_INSTANCES within `window_s` (a timeout with none is the pass)."""
    js = nc.jetstream()  # type: ignore[attr-defined]
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    # Changes are the revisions after this one. nats-py's end-of-initial-values marker is not
    # enough: under load it can come before the initial values (consumer info already says
    # none pending while they sit unread in the client's buffer).
    before = (await js.stream_info(f"KV_{subjects.INSTANCES_BUCKET}")).state.last_seq
    watcher = await kv.watchall()
    seen: list[str] = []
    deadline = time.monotonic() + window_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await watcher.updates(timeout=left)
            except TimeoutError:
                break
            if entry is not None and entry.revision > before:
                seen.append(f"{entry.operation or 'PUT'} {entry.key}")
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()
    return seen


async def test_an_instance_stranded_on_a_node_that_died_alone_is_healed_by_a_later_worker(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    nc = await client(nats_url)
    js = nc.jetstream()
    stranded = Instance(
        instance_id="tiny-llm-stranded", model="tiny-llm", slots=2, created_at=time.time(),
        shards=[ShardAssignment(node_id="ghost-node", runner_id="run-gone", end_layer=2)],
    )
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    await kv.create(stranded.instance_id, encode(stranded))  # its node never beats again

    worker = start_worker("late")
    node = await wait_node(nc, worker.data_dir)
    # Healing waits for a TTL of good heartbeats, then a runner starts: bounded generously.
    result = finished(await run_task(nc, hello("after-healing"), timeout=120))
    assert result.status == "completed" and result.node_id == node
    [healed] = await read_instances(js)
    assert healed.instance_id == "tiny-llm-stranded"
    assert [s.node_id for s in healed.shards] == [node]
    assert "moved tiny-llm-stranded" in worker.log()
    await nc.close()


async def test_a_task_on_an_instance_that_moves_away_is_not_reported_cancelled(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    """A move the failover made (here by hand, as a worker that judged `a` dead would) stops
    `a`'s runner. Its running task was cancelled by nobody: it must be handed back or end
    with another reason, never `cancelled`."""
    a, b = start_worker("a"), start_worker("b")
    card = add_fault_card(a.data_dir)
    add_fault_card(b.data_dir)
    nc = await client(nats_url)
    node_a, node_b = await wait_node(nc, a.data_dir), await wait_node(nc, b.data_dir)
    await place_and_wait(nc, card, node_a, slots=2)
    task = TextGeneration(
        task_id="moved-under-it", model="fault-llm", max_tokens=1000,
        messages=[ChatMessage(role="user", content="tokens:40 delay_ms:100")],
    )
    collector = asyncio.create_task(events_of(nc, task.task_id, timeout=90))
    running = asyncio.Event()
    sub = await nc.subscribe(subjects.out(task.task_id), cb=partial(_seen, running))
    await submit(nc, task)
    await asyncio.wait_for(running.wait(), 30)
    await sub.unsubscribe()

    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    [instance] = await read_instances(nc.jetstream())
    entry = await kv.get(instance.instance_id)
    await kv.update(instance.instance_id, encode(moved(instance, node_a, node_b)),
                    last=entry.revision)
    result = finished(await collector)
    assert result.status != "cancelled" and result.reason != ErrorReason.CANCELLED, result
    await nc.close()


async def _seen(event: asyncio.Event, msg: Msg) -> None:
    if b'"type":"token"' in msg.data:
        event.set()
