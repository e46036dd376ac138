"""The task queue and the typed KV records (fleet.bus.task_queue, fleet.bus.records, the TTL
calls of fleet.bus.kv_calls) against a real, provisioned nats-server: each call does what its
callers (the janitor, the claims, the gateway's owners, `fleet cancel`) relied on when they
made it themselves."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client

from fleet.bus.kv_calls import bucket_max_age, get_direct, put_with_ttl, stream_exists
from fleet.bus.provision import ensure_task_consumer
from fleet.bus.records import CancelRecords, ClaimRecords
from fleet.bus.task_log import TaskLog
from fleet.bus.task_queue import TaskQueue, nak_held
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.events import TaskFence, TaskRefused
from fleet.wire.tasks import CancelTask


async def test_queue_counts_reads_purges_and_dead_letters(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    queue = TaskQueue(provisioned_nc)
    a = [(await js.publish(subjects.tasks("qa"), f"a{i}".encode())).seq for i in range(3)]
    await js.publish(subjects.tasks("qb"), b"b0")
    assert await queue.counts() == {subjects.tasks("qa"): 3, subjects.tasks("qb"): 1}

    first = await queue.next_on(subjects.tasks("qa"), 0)
    assert first is not None and first.seq == a[0] and first.data == b"a0"
    assert await queue.next_on(subjects.tasks("qa"), a[2]) is None
    await queue.purge_through(subjects.tasks("qa"), a[1])  # a task published since stays
    assert await queue.counts() == {subjects.tasks("qa"): 1, subjects.tasks("qb"): 1}

    await queue.dead_letter("qa", b"a2", a[2], 5)
    await queue.dead_letter("qa", b"a2", a[2], 5)  # redelivered advisory: one copy
    dead = await js.stream_info("FLEET_DEAD", subjects_filter=subjects.dead_letter("qa"))
    assert dead.state.messages == 1
    assert (await queue.get(a[2])).data == b"a2"
    await queue.delete(a[2])
    assert await queue.counts() == {subjects.tasks("qb"): 1}


async def test_a_refusal_is_recorded_once_and_told_to_the_inbox(provisioned_nc: Client) -> None:
    nc = provisioned_nc
    inbox, heard = nc.new_inbox(), asyncio.Queue[bytes]()

    async def got(msg: object) -> None:
        await heard.put(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(inbox, cb=got)
    event = TaskRefused(task_id="r1", model="qa", reason="task_id_taken", message="x", at=1.0,
                        stream_seq=7)
    for _ in range(2):
        await TaskQueue(nc).refuse("qa", event, inbox)
    told = decode_model(TaskRefused, await asyncio.wait_for(heard.get(), 5.0))
    assert told.task_id == "r1"
    info = await nc.jetstream().stream_info(subjects.REFUSED_STREAM,
                                            subjects_filter=subjects.refused("qa"))
    assert info.state.messages == 1


async def test_claim_and_cancel_records(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    claims = await ClaimRecords.open(js)
    assert await claims.create("c1", "11")
    assert not await claims.create("c1", "12")  # held, whoever asks
    assert await claims.holder("c1") == "11"
    assert await claims.holder("c2") is None
    await claims.hold("c1", "used-12")
    assert await claims.holder("c1") == "used-12"

    cancels = await CancelRecords.open(js)
    assert not await cancels.cancelled("k1")
    await cancels.record(CancelTask(task_id="k1", reason="test"))
    assert await cancels.cancelled("k1")


async def test_fence_compare_and_set(provisioned_nc: Client) -> None:
    log = TaskLog(provisioned_nc)
    assert await log.last_fence("f1") == (0, None)
    fence = TaskFence(task_id="f1", attempt=1, node_id="n", delivery=2, at=1.0)
    seq = await log.put_fence(fence, 0)
    assert await log.last_fence("f1") == (seq, fence)
    try:
        await log.put_fence(fence, 0)  # written meanwhile: the stream refuses a stale read
    except Exception as exc:
        assert getattr(exc, "err_code", None) == 10071
    else:
        raise AssertionError("a stale fence was stored")
    assert not await log.has_events("f1")  # a fence is not an event of the task


async def test_ttl_records_and_bucket_age(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    assert await get_direct(js, "FLEET_TENANTS", "task.x") is None
    await put_with_ttl(js, "FLEET_TENANTS", "task.x", b"v", 60)
    assert await get_direct(js, "FLEET_TENANTS", "task.x") == b"v"
    assert (await bucket_max_age(js, subjects.NODES_BUCKET) or 0) > 0


async def test_instance_node_and_runner_records(provisioned_nc: Client) -> None:
    from fleet.bus.kv_calls import open_bucket
    from fleet.bus.records import InstanceRecords, NodeRecords, RunnerRecords
    from fleet.wire.cluster import Instance, NodeInfo, RunnerRecord, ShardAssignment
    from fleet.wire.runners import RunnerIdle

    js = provisioned_nc.jetstream()
    instances = InstanceRecords(await open_bucket(js, subjects.INSTANCES_BUCKET))
    placed = Instance(instance_id="i1", model="m", created_at=1.0,
                      shards=[ShardAssignment(node_id="n1", runner_id="pending")])
    assert await instances.create(placed)
    assert not await instances.create(placed)  # placed already: one answer
    stored = await instances.get("i1")
    assert stored is not None and stored[0] == placed
    bumped = placed.model_copy(update={"generation": 1})
    assert await instances.update(bumped, stored[1])
    assert not await instances.update(bumped, stored[1])  # a stale revision loses
    await instances.delete("i1")
    assert await instances.get("i1") is None

    nodes = NodeRecords(await open_bucket(js, subjects.NODES_BUCKET))
    await nodes.put(NodeInfo(node_id="n1", hostname="h", memory_total_bytes=1,
                             memory_available_bytes=1, cpu_count=1, started_at=0.0, at=0.0))
    await nodes.delete("n1")
    runners = RunnerRecords(await open_bucket(js, subjects.RUNNERS_BUCKET))
    record = RunnerRecord(runner_id="r1", instance_id="i1", node_id="n1", model="m",
                          status=RunnerIdle(), slots=1, at=1.0)
    await runners.put(record)
    kv = await js.key_value(subjects.RUNNERS_BUCKET)
    assert RunnerRecord.model_validate_json((await kv.get("r1")).value or b"") == record
    await runners.delete("r1")


async def test_consumer_and_dead_letter_reads(provisioned_nc: Client) -> None:
    """What the gateway's metrics and the dashboard read: the consumers' counts, the dead
    letters per model, and the newest dead letters with the janitor's headers."""
    nc, queue = provisioned_nc, TaskQueue(provisioned_nc)
    await ensure_task_consumer(nc, "qd")
    seqs = [(await nc.jetstream().publish(subjects.tasks("qd"), f"d{i}".encode())).seq
            for i in range(3)]
    for seq in seqs:
        await queue.dead_letter("qd", f"d{seq}".encode(), seq, 5)
    named = {c.name: c for c in await queue.consumers()}
    assert named[subjects.durable("qd")].num_ack_pending == 0
    assert await queue.dead_counts() == {subjects.dead_letter("qd"): 3}
    newest = await queue.newest_dead(2)
    assert [m.data for m in newest] == [f"d{seqs[2]}".encode(), f"d{seqs[1]}".encode()]
    assert (newest[0].headers or {})["Fleet-Reason"] == "max_deliveries"
    assert await stream_exists(nc.jetstream(), "FLEET_DEAD", budget_s=1.0)
    assert not await stream_exists(nc.jetstream(), "KV_NO_SUCH_BUCKET", budget_s=1.0)


async def test_a_held_delivery_is_nakd_by_its_ack_subject(provisioned_nc: Client,
                                                          nats_url: str) -> None:
    """The death watch's verb: another connection naks a delivery it does not hold, and the
    broker hands the message out again at once (not after AckWait's 30 s)."""
    nc = provisioned_nc
    await ensure_task_consumer(nc, "qn")
    await nc.jetstream().publish(subjects.tasks("qn"), b"held")
    sub = await nc.jetstream().pull_subscribe("", durable=subjects.durable("qn"),
                                              stream=subjects.TASKS_STREAM)
    [first] = await sub.fetch(1, timeout=5.0)
    assert first.metadata.num_delivered == 1
    watcher = await nats.connect(nats_url)
    try:
        await nak_held(watcher, first.reply, what="nak a dead node's task", budget_s=2.0)
        with pytest.raises(ValueError):  # a subject read from a message is a capability
            await nak_held(watcher, "fleet.tasks.qn", what="not an ack", budget_s=2.0)
    finally:
        await watcher.close()
    [again] = await sub.fetch(1, timeout=5.0)
    assert again.data == b"held" and again.metadata.num_delivered == 2


async def test_a_cancel_is_recorded_then_announced(provisioned_nc: Client) -> None:
    """CancelRecords.send, the one cancel writer (gateway, `fleet cancel`)."""
    nc = provisioned_nc
    heard = asyncio.Queue[bytes]()

    async def got(msg: object) -> None:
        await heard.put(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(subjects.cancel("c-send"), cb=got)
    records = await CancelRecords.open(nc.jetstream(), budget_s=5.0)
    await records.send(CancelTask(task_id="c-send", reason="test"))
    told = decode_model(CancelTask, await asyncio.wait_for(heard.get(), 5.0))
    assert told.task_id == "c-send" and told.reason == "test"
    assert await records.cancelled("c-send")


async def until_pending(queue: TaskQueue, name: str, want: int, timeout: float = 10) -> None:
    """Returns once the durable's pending count reads `want` (TimeoutError if it never does).
    The server counts a stored message into a consumer's pending from its own signal loop,
    after the publish is acknowledged: CI under load read 1 of 2 just published."""
    async with asyncio.timeout(timeout):
        while (info := await queue.durable(name)) is None or info.num_pending != want:
            await asyncio.sleep(0.02)


async def test_durable_reads_and_the_guards_calls(provisioned_nc: Client) -> None:
    """The puller's and the batch slack's durable look-up (None when gone), and the consumer
    guard's JSON calls: its config, the first task after a position, the count on a subject,
    a rewrite of its config and a reset of its position."""
    nc, queue = provisioned_nc, TaskQueue(provisioned_nc)
    name = subjects.durable("qg")
    assert await queue.durable(name) is None
    assert await queue.durable_json(name) is None
    await ensure_task_consumer(nc, "qg")
    seqs = [(await nc.jetstream().publish(subjects.tasks("qg"), b"g")).seq for _ in range(2)]
    await until_pending(queue, name, 2)
    raw = await queue.durable_json(name)
    assert raw is not None and raw["config"]["filter_subject"] == subjects.tasks("qg")
    assert await queue.first_seq_on(subjects.tasks("qg"), 1) == seqs[0]
    assert await queue.first_seq_on(subjects.tasks("qg"), seqs[1] + 1) is None
    assert await queue.stored_on(subjects.tasks("qg")) == 2
    answer = await queue.put_durable(name, {**raw["config"], "max_ack_pending": 7})
    assert answer["config"]["max_ack_pending"] == 7
    sub = await nc.jetstream().pull_subscribe_bind(name, stream=subjects.TASKS_STREAM)
    assert len(await sub.fetch(2, timeout=2)) == 2  # delivered, not acked
    assert "error" not in await queue.reset_durable(name, seqs[1])
    await until_pending(queue, name, 1)  # the second one is owed again
