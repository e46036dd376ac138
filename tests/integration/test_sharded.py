"""A model over two nodes: two `fleet worker` processes, each with its own data dir, against
one real nats-server; the instance's two shards form a ring over mx.distributed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.config import load_settings
from fleet.gateway.app import build_app
from fleet.models.catalog import get_card
from fleet.placement import place, read_instances, remove
from fleet.trace.lookup import spans_of_trace
from fleet.wire import subjects
from fleet.wire.cluster import Instance, RunnerRecord
from fleet.wire.codec import decode_events, decode_model
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import (
    STANDBY,
    WorkerProcess,
    client,
    finished,
    run_task,
    submit,
    text_of,
    until_key,
    wait_capabilities,
    wait_node,
)


def paris(task_id: str) -> TextGeneration:
    return TextGeneration(
        task_id=task_id, model="smollm2-135m", max_tokens=12, temperature=0.0,
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
    )


async def ready_ranks(
    nc: Client, instance: Instance, timeout: float = 240.0, before: Iterable[str] = (),
) -> dict[int, str]:
    """Until every rank's runner of `instance` (as it is now; none of the runners `before`)
    has reported ready (one KV watch); their runner ids by rank."""
    old = set(before)
    kv = await nc.jetstream().key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    nodes = {s.rank: s.node_id for s in instance.shards}
    ranks: dict[int, str] = {}
    try:
        async with asyncio.timeout(timeout):
            while set(ranks) != set(nodes):
                entry = await watcher.updates(timeout=timeout)
                if entry is None or not entry.value:
                    continue
                record = decode_model(RunnerRecord, entry.value)
                if (record.instance_id == instance.instance_id and record.status.state == "ready"
                        and nodes.get(record.rank) == record.node_id
                        and record.runner_id not in old):
                    ranks[record.rank] = record.runner_id
    finally:
        await watcher.stop()
    return ranks


async def test_smollm2_over_two_nodes_answers_with_the_unsharded_tokens(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path, tmp_path: Path,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    first = start_worker("w1", models=models, **STANDBY)
    second = start_worker("w2", models=models, **STANDBY)
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
    tokens = [i for e in events if isinstance(e, TokenChunk) for i in e.ids]
    assert tokens == [i for e in unsharded if isinstance(e, TokenChunk) for i in e.ids]
    accepted = [e for e in events if e.type == "task_accepted"]
    assert [e.node_id for e in accepted] == [sharded.shards[0].node_id]  # rank 0's worker
    # Each rank traced its share of the task: a generation span with its rank, and its phases.
    trace_id = accepted[0].trace_id
    assert trace_id is not None
    async with asyncio.timeout(60):
        while True:
            spans = await spans_of_trace(js, trace_id)
            ranks = {s["attributes"].get("fleet.rank") for s in spans if "attributes" in s}
            if {0, 1} <= ranks:
                break
            await asyncio.sleep(0.2)  # the workers export finished spans in batches; bounded
    assert sum(1 for s in spans if s["name"] == "decode") == 2

    # The same question through the gateway, a stateless sidecar on the same subjects.
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path / "gw"}, env={})
    app = build_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120,
    ) as http:
        reply = await http.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "max_tokens": 12, "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == text_of(unsharded)

    # Removed: rank 0 tells rank 1 to stop, and both runners shut down cleanly.
    await remove(js, sharded.instance_id)
    for worker in (first, second):
        await until_logged(worker, "exited with code 0", count=1 + (worker is first))
    assert "did not stop" not in first.log() + second.log()
    await nc.close()


async def until_logged(worker: WorkerProcess, text: str, count: int, timeout: float = 60) -> None:
    """Until the worker's log holds `text` `count` times (a bounded poll of its log file)."""
    async with asyncio.timeout(timeout):
        while worker.log().count(text) < count:
            await asyncio.sleep(0.1)


async def test_a_rank_whose_worker_is_killed_mid_task_is_re_placed_and_the_group_serves_again(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    workers = [start_worker(f"w{i}", models=models, **STANDBY) for i in range(3)]
    nc = await client(nats_url)
    by_node = {await wait_node(nc, w.data_dir): w for w in workers}
    js = nc.jetstream()
    sharded = await place(js, get_card("smollm2-135m"), slots=2, shards=2)
    before = await ready_ranks(nc, sharded)
    follower = by_node[sharded.shards[1].node_id]

    async def heal() -> Instance:
        healed = await moved_away(nc, sharded.instance_id, follower.node_id)
        assert [s.rank for s in healed.shards] == [0, 1]
        assert healed.shards[0].node_id == sharded.shards[0].node_id
        return healed

    # rank 1's worker and its runner, as a power loss would
    await kill_a_rank_mid_task(nc, "killed-1", follower.kill, heal, before.values())
    await nc.close()


async def test_a_rank_whose_runner_dies_mid_task_restarts_the_whole_group(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path,
) -> None:
    models = {"smollm2-135m": smollm2_dir}
    workers = [start_worker(f"w{i}", models=models, **STANDBY) for i in range(2)]
    nc = await client(nats_url)
    for worker in workers:
        await wait_node(nc, worker.data_dir)
    sharded = await place(nc.jetstream(), get_card("smollm2-135m"), slots=2, shards=2)
    runners = await ready_ranks(nc, sharded)

    def kill_rank_1_runner() -> None:
        logs = "".join(worker.log() for worker in workers)
        pid = re.search(rf"runner {runners[1]} started, pid (\d+)", logs)
        assert pid is not None
        os.kill(int(pid.group(1)), signal.SIGKILL)

    async def regrouped() -> Instance:
        instance = await next_generation(nc, sharded.instance_id)
        assert instance.shards == sharded.shards and instance.generation == 1
        return instance

    await kill_a_rank_mid_task(nc, "crashed-1", kill_rank_1_runner, regrouped, runners.values())
    await nc.close()


async def kill_a_rank_mid_task(
    nc: Client, task_id: str, kill: Callable[[], None],
    regrouped: Callable[[], Awaitable[Instance]], before: Iterable[str],
) -> None:
    """Start a task, `kill` once its first token is out, then: exactly one terminal (the
    task continued, or ended runner_crashed), the group ready again, the next task served."""
    task = paris(task_id).model_copy(update={"max_tokens": 64})
    first_token, ended = asyncio.Event(), asyncio.Event()
    got: list[object] = []

    async def on_event(msg: Msg) -> None:
        for event in decode_events(msg.data):  # a terminal may carry the last tokens
            got.append(event)
            if isinstance(event, TokenChunk):
                first_token.set()
            if isinstance(event, TaskFinished):
                ended.set()

    sub = await nc.jetstream().subscribe(
        subjects.out(task.task_id), stream=subjects.OUT_STREAM, ordered_consumer=True,
        cb=on_event,
    )
    await submit(nc, task)
    await asyncio.wait_for(first_token.wait(), 120)
    kill()
    await ready_ranks(nc, await regrouped(), before=before)
    await asyncio.wait_for(ended.wait(), 240)
    await sub.unsubscribe()
    terminal = finished(got)  # exactly one
    assert terminal.status == "completed" or terminal.reason == "runner_crashed"
    after = await run_task(nc, paris(f"after-{task_id}"), timeout=240)
    assert finished(after).status == "completed" and "Paris" in text_of(after)


async def next_generation(nc: Client, instance_id: str, timeout: float = 120) -> Instance:
    """The instance once it has been placed again (a generation past its first)."""
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)

    def regenerated(value: bytes) -> Instance | None:
        instance = decode_model(Instance, value)
        return instance if instance.generation > 0 else None

    return await until_key(kv, instance_id, regenerated, timeout)


async def moved_away(nc: Client, instance_id: str, gone: str, timeout: float = 120) -> Instance:
    """The instance once failover has moved its shard off the node `gone`."""
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)

    def off_gone(value: bytes) -> Instance | None:
        instance = decode_model(Instance, value)
        return instance if all(s.node_id != gone for s in instance.shards) else None

    return await until_key(kv, instance_id, off_gone, timeout)


async def test_a_task_for_a_model_no_node_can_hold_places_it_split_over_two_nodes(
    nats_url: str, start_worker: WorkerFactory, smollm2_dir: Path, tmp_path: Path,
) -> None:
    # 538 MB of smollm2 against 350 MB a node: no node alone; two nodes with 15 layers each
    # (each rank also holds the 113 MB embedding: 325 MB).
    small = {"FLEET_MEMORY_LIMIT": "350000000", "FLEET_AUTO_PLACE": "1", **STANDBY}
    workers = [start_worker(f"w{i}", models={"smollm2-135m": smollm2_dir}, **small)
               for i in range(2)]
    nc = await client(nats_url)
    nodes = {await wait_node(nc, w.data_dir) for w in workers}
    await wait_capabilities(nc, nodes)  # what the gateway reads of them
    # Through the gateway: it must not refuse a model that only a split can serve.
    settings = load_settings({"nats_url": nats_url, "data_dir": tmp_path / "gw"}, env={})
    app = build_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=240,
    ) as http:
        reply = await http.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "max_tokens": 12, "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
    assert reply.status_code == 200, reply.text
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]
    [placed] = await read_instances(nc.jetstream())
    assert placed.instance_id == "smollm2-135m-auto"
    assert {s.node_id for s in placed.shards} == nodes
    assert [(s.start_layer, s.end_layer) for s in placed.shards] == [(0, 15), (15, 30)]
    await nc.close()
