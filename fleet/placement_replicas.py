"""Placing R replicas of a model: one instance (one runner) each, spread over the live nodes.

`choose_nodes` is pure: replica by replica, the node with the most memory left once the
replicas already given to it are counted, so R replicas land on one node when only one can
hold them and spread when several can. Each replica is its own `Instance`, so failover, the
runner lifecycle and the per-runner prefix index treat it like any other.
"""

from __future__ import annotations

import time

from nats.js import JetStreamContext

from fleet.bus.kv_calls import kv_create
from fleet.errors import InvalidRequest, PlacementError
from fleet.placement import candidates, choose_node, new_instance, read_nodes, refusal
from fleet.wire import subjects
from fleet.wire.cluster import Instance, ModelCard, NodeInfo
from fleet.wire.codec import encode


def choose_nodes(
    nodes: list[NodeInfo], card: ModelCard, replicas: int, now: float,
) -> list[NodeInfo]:
    """A node per replica. Files on disk first (no fetch), then the memory left after the
    replicas already chosen; a node that cannot hold one more replica is not chosen."""
    if replicas < 1:
        raise InvalidRequest("replicas must be at least 1")
    live = [n for n in nodes if refusal(n, card, now) is None]
    if not live:
        choose_node(nodes, card, now)  # raises, with each node's reason
    given: dict[str, int] = {}
    chosen: list[NodeInfo] = []
    for _ in range(replicas):
        def left(node: NodeInfo) -> int:
            return node.memory_available_bytes - given.get(node.node_id, 0) * card.size_bytes
        fitting = [n for n in live if left(n) >= card.size_bytes]
        if not fitting:
            raise PlacementError(
                f"no live node can hold replica {len(chosen) + 1} of {card.id} "
                f"({len(live)} live node(s))"
            )
        best = max(fitting, key=lambda n: (card.id in n.models_on_disk, left(n), n.node_id))
        given[best.node_id] = given.get(best.node_id, 0) + 1
        chosen.append(best)
    return chosen


async def place_replicas(
    js: JetStreamContext, card: ModelCard, replicas: int, *, node_id: str | None = None,
    slots: int = 0,
) -> list[Instance]:
    """Write `replicas` new instances of `card` (create-only keys), on `node_id` if given."""
    nodes = candidates(await read_nodes(js), card, node_id)
    now = time.time()
    kv = await js.key_value(subjects.INSTANCES_BUCKET)
    placed = []
    for node in choose_nodes(nodes, card, replicas, now):
        instance = new_instance(card, node, slots, now)
        if await kv_create(kv, instance.instance_id, encode(instance)) is None:
            raise PlacementError(f"instance {instance.instance_id} exists already")
        placed.append(instance)
    return placed
