"""Placing model instances: a pure choice of node (fleet.placement_rules), written with a KV
compare-and-set. The rules' names are importable from here too, for the callers of `place`."""

from __future__ import annotations

import time

from nats.js import JetStreamContext

from fleet.bus.kv_calls import get_from_leader, open_bucket
from fleet.bus.kv_read import live_values
from fleet.bus.records import InstanceRecords
from fleet.errors import InvalidRequest, PlacementError
from fleet.placement_rules import (
    HEARTBEAT_STALE_S,
    able_to_shard,
    candidates,
    choose_node,
    files_bytes,
    in_groups,
    moved,
    new_instance,
    refusal,
    sharded_instance,
    unprovided,
)
from fleet.placement_shards import ShardingError, choose_shards
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo
from fleet.wire.codec import DecodeError, decode_model

__all__ = [
    "HEARTBEAT_STALE_S",
    "able_to_shard",
    "candidates",
    "choose_node",
    "files_bytes",
    "find_instance",
    "in_groups",
    "moved",
    "new_instance",
    "place",
    "read_instances",
    "read_node",
    "read_nodes",
    "refusal",
    "remove",
    "sharded_instance",
    "unprovided",
]


async def read_nodes(js: JetStreamContext) -> list[NodeInfo]:
    return await live_values(js, subjects.NODES_BUCKET, NodeInfo)


async def read_node(js: JetStreamContext, node_id: str) -> list[NodeInfo]:
    """The named node's heartbeat, read by key from the bucket's stream leader: [] when it has
    none. A snapshot of the whole bucket (`read_nodes`) is served by its consumer's leader,
    and a plain `get` by any replica (the bucket allows direct gets); in a cluster either can
    be a replica that has not applied a heartbeat written a moment ago (CI, twice: a placement
    on a node the caller had just seen register found no node at all)."""
    value = await get_from_leader(js, subjects.NODES_BUCKET, node_id)
    if value is None:
        return []
    try:
        return [decode_model(NodeInfo, value)]
    except DecodeError:  # a writer of another schema version: not a node this one can use
        return []


async def read_instances(js: JetStreamContext) -> list[Instance]:
    return await live_values(js, subjects.INSTANCES_BUCKET, Instance)


async def find_instance(js: JetStreamContext, model: str) -> Instance | None:
    """An instance of `model` the fleet has already, wherever it is placed."""
    return next((i for i in await read_instances(js) if i.model == model), None)


async def place(
    js: JetStreamContext, card: ModelCard, *, node_id: str | None = None, slots: int = 0,
    if_absent: bool = False, shards: int = 1,
) -> Instance:
    """Write a placement; `if_absent` keeps an existing instance of the model instead;
    `shards` > 1 splits the model's layers over that many nodes (a pipeline)."""
    if if_absent and (existing := await find_instance(js, card.id)):
        return existing
    now = time.time()
    if shards > 1:
        if node_id:
            raise InvalidRequest("a sharded instance spans nodes: --node does not apply")
        able = able_to_shard(candidates(await read_nodes(js), card, None), card, now)
        busy = in_groups(await read_instances(js))
        try:
            assignments = choose_shards(able, card, shards, busy)
        except ShardingError as exc:
            raise PlacementError(str(exc)) from exc
        instance = sharded_instance(card, assignments, slots, now)
    else:
        found = await read_node(js, node_id) if node_id else await read_nodes(js)
        nodes = candidates(found, card, node_id)
        instance = new_instance(card, choose_node(nodes, card, now), slots, now)
    records = InstanceRecords(await open_bucket(js, subjects.INSTANCES_BUCKET))
    if not await records.create(instance):  # compare-and-set: a new key
        raise PlacementError(f"instance {instance.instance_id} exists already")
    return instance


async def remove(js: JetStreamContext, instance_id: str) -> None:
    await InstanceRecords(await open_bucket(js, subjects.INSTANCES_BUCKET)).delete(instance_id)
