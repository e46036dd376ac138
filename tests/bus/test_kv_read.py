"""Listing a KV bucket must see every key written before the listing began.

nats-py's `KeyValue.keys()` missed a just-written key about 2 times in 100 here (its "nothing
pending" marker can overtake the entries); `fleet up` then did not find its own node.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.kv_read import FETCH_BATCH, live_entries, live_values
from fleet.placement import read_instances, read_node, read_nodes
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, ShardAssignment
from fleet.wire.codec import encode

ROUNDS = 200  # with keys(), P(no miss in 200 rounds) is about 1%


def _instance(n: int) -> Instance:
    return Instance(
        instance_id=f"tiny-llm-{n}", model="tiny-llm", slots=1, created_at=0.0,
        shards=[ShardAssignment(node_id="n1", runner_id="pending", end_layer=2)],
    )


async def test_every_key_written_before_a_listing_is_in_it(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    for n in range(ROUNDS):
        await kv.put(f"tiny-llm-{n}", encode(_instance(n)))
        if n:
            await kv.delete(f"tiny-llm-{n - 1}")
        assert await read_instances(js) == [_instance(n)], f"round {n}"


async def test_deleted_keys_and_bad_values_are_left_out(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    await kv.put("kept", encode(_instance(1)))
    await kv.put("gone", encode(_instance(2)))
    await kv.delete("gone")
    await kv.put("garbage", b"{not json")
    assert [e.key for e in await live_entries(js, subjects.INSTANCES_BUCKET)] == [
        "garbage", "kept",
    ]
    assert await live_values(js, subjects.INSTANCES_BUCKET, Instance) == [_instance(1)]


async def test_a_listing_reads_past_one_fetch_of_removed_keys(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    for n in range(FETCH_BATCH + 10):
        await kv.put(f"tiny-llm-{n}", encode(_instance(n)))
        if n % 7:
            await kv.delete(f"tiny-llm-{n}")
    entries = await live_entries(js, subjects.INSTANCES_BUCKET)
    assert sorted(int(e.key.rsplit("-", 1)[1]) for e in entries) == list(
        range(0, FETCH_BATCH + 10, 7)
    )
    assert all(e.revision > 0 for e in entries)
    consumers = await js.consumers_info(f"KV_{subjects.INSTANCES_BUCKET}")
    assert consumers == []  # each listing removes its consumer


async def test_a_node_registered_just_now_is_found(provisioned_nc: Client) -> None:
    js = provisioned_nc.jetstream()
    nodes = await js.key_value(subjects.NODES_BUCKET)
    assert await read_nodes(js) == []
    info = NodeInfo(
        node_id="n1", hostname="h", started_at=time.time(), at=time.time(),
        memory_total_bytes=1, memory_available_bytes=1, cpu_count=2,
    )
    await nodes.put("n1", encode(info))
    assert await read_nodes(js) == [info]


async def test_a_named_node_is_read_by_its_key(provisioned_nc: Client) -> None:
    """`place(node_id=...)` reads the one node by key, from the stream's leader (a bucket
    snapshot is served by its consumer's leader, which in a cluster can lag a moment)."""
    js = provisioned_nc.jetstream()
    nodes = await js.key_value(subjects.NODES_BUCKET)
    assert await read_node(js, "n1") == []
    info = NodeInfo(
        node_id="n1", hostname="h", started_at=time.time(), at=time.time(),
        memory_total_bytes=1, memory_available_bytes=1, cpu_count=2,
    )
    await nodes.put("n1", encode(info))
    await nodes.put("n2", b"{not json")
    assert await read_node(js, "n1") == [info]
    assert await read_node(js, "n2") == []
    await nodes.delete("n1")
    assert await read_node(js, "n1") == []


async def test_a_named_node_is_asked_of_the_stream_leader_not_any_replica(
    provisioned_nc: Client,
) -> None:
    """The bucket allows direct gets, which any replica answers, so a plain `get` can miss a
    heartbeat a lagging replica has not applied; `read_node` asks the leader's API. Seen on
    the wire: the server hands our subscription a copy of each API request."""
    js = provisioned_nc.jetstream()
    stream = f"KV_{subjects.NODES_BUCKET}"
    asked: list[str] = []
    first = asyncio.Event()

    async def heard(msg: Msg) -> None:
        asked.append(msg.subject)
        first.set()

    leader = await provisioned_nc.subscribe(f"$JS.API.STREAM.MSG.GET.{stream}", cb=heard)
    direct = await provisioned_nc.subscribe(f"$JS.API.DIRECT.GET.{stream}.>", cb=heard)
    direct_plain = await provisioned_nc.subscribe(f"$JS.API.DIRECT.GET.{stream}", cb=heard)
    assert await read_node(js, "n1") == []
    await asyncio.wait_for(first.wait(), 10)
    assert asked == [f"$JS.API.STREAM.MSG.GET.{stream}"]
    for sub in (leader, direct, direct_plain):
        await sub.unsubscribe()
