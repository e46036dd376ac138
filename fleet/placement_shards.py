"""Placing one model over several nodes: a pipeline of N shards, layers split by free memory.

Pure: `split_layers` (how many layers each node takes) and `choose_shards` (which nodes, which
ranks); `fleet.placement.place` writes the result with the same create-only compare-and-set as
a one-node instance. Rank 0 runs the first layers and is the rank whose worker pulls the
instance's tasks; it goes to the node with the most free memory. A node takes part in one group
at a time: it has one ring address (its heartbeat's `ring_address`).
"""

from __future__ import annotations

from collections.abc import Collection

from fleet.errors import InvalidRequest
from fleet.wire.cluster import Instance, ModelCard, NodeInfo, ShardAssignment


class ShardingError(Exception):
    """The model cannot be split over these nodes; the message says why."""


def layer_bytes(card: ModelCard) -> int:
    """What one layer costs in memory: the weights outside the layers (`shared_bytes`, held
    by every rank) are not in it, unless the card does not know them (then spread over the
    layers)."""
    return -(-max(card.size_bytes - card.shared_bytes, 0) // max(card.n_layers, 1))


def rank_bytes(card: ModelCard, layers: int) -> int:
    """What a rank with `layers` layers holds: its layers and the shared weights."""
    return card.shared_bytes + layers * layer_bytes(card)


def split_layers(n_layers: int, free: list[int], per_layer: int, shared: int = 0) -> list[int]:
    """Layers per node, in proportion to the memory each node has left once it holds the
    `shared` weights every rank holds, each at least one and none more than its memory holds.
    Largest remainders settle the rounding. Pure."""
    if not free:
        raise InvalidRequest("a split needs at least one node")
    if n_layers < len(free):
        raise ShardingError(f"{n_layers} layer(s) cannot be split over {len(free)} shards")
    room = [max(f - shared, 0) for f in free]
    fits = [r // max(per_layer, 1) for r in room]
    besides = f", besides the {shared / 1e6:.0f} MB every rank holds" if shared else ""
    if min(fits) == 0:
        raise ShardingError(
            f"a node with {min(free) / 1e6:.0f} MB free cannot hold one layer "
            f"({per_layer / 1e6:.0f} MB){besides}"
        )
    if sum(fits) < n_layers:
        raise ShardingError(
            f"the {len(free)} node(s) hold {sum(fits)} of the {n_layers} layers in their free "
            f"memory{besides}"
        )
    total = sum(room) or 1
    shares = [n_layers * r / total for r in room]
    counts = [max(1, min(int(share), fit)) for share, fit in zip(shares, fits, strict=True)]
    nodes = range(len(free))
    # Hand out (or take back) the rounding: most owed first, within each node's fit.
    while sum(counts) < n_layers:
        room_left = [i for i in nodes if counts[i] < fits[i]]
        counts[max(room_left, key=lambda i: (shares[i] - counts[i], free[i], -i))] += 1
    while sum(counts) > n_layers:
        spare = [i for i in nodes if counts[i] > 1]
        counts[min(spare, key=lambda i: (shares[i] - counts[i], free[i], -i))] -= 1
    return counts


def choose_shards(
    nodes: list[NodeInfo], card: ModelCard, shards: int, busy: Collection[str] = (),
) -> list[ShardAssignment]:
    """`shards` ranks over the nodes with the most free memory among those with a ring
    address and not already in a group (`busy`); rank 0 first (most memory), layers by
    free memory. `nodes` are those already judged able to serve (alive, files). Pure."""
    if shards < 2:
        raise InvalidRequest("a sharded instance has at least 2 shards")
    if card.n_layers < shards:
        raise ShardingError(f"{card.id} has {card.n_layers} layer(s): not {shards} shards")
    ringed = [n for n in nodes if n.ring_address and n.node_id not in busy]
    if len(ringed) < shards:
        skipped = sorted(n.node_id for n in nodes if n not in ringed)
        why = f" ({', '.join(skipped)}: no ring address or in another group)" if skipped else ""
        raise ShardingError(
            f"{shards} shards of {card.id} need {shards} live nodes that can join a ring, "
            f"{len(ringed)} can{why}"
        )
    chosen = sorted(ringed, key=lambda n: (-n.memory_available_bytes, n.node_id))[:shards]
    counts = split_layers(
        card.n_layers, [n.memory_available_bytes for n in chosen], layer_bytes(card),
        card.shared_bytes,
    )
    assignments, start = [], 0
    for rank, (node, count) in enumerate(zip(chosen, counts, strict=True)):
        assignments.append(ShardAssignment(
            node_id=node.node_id, runner_id="pending", rank=rank, world_size=shards,
            start_layer=start, end_layer=start + count, ring_address=node.ring_address,
        ))
        start += count
    return assignments


def fewest_shards(
    nodes: list[NodeInfo], card: ModelCard, busy: Collection[str] = (),
) -> list[ShardAssignment]:
    """The smallest group (2, 3, … nodes) that holds the model: placement on demand of a
    model no single node can hold. Pure."""
    last: ShardingError | None = None
    for shards in range(2, max(len(nodes), 2) + 1):
        try:
            return choose_shards(nodes, card, shards, busy)
        except ShardingError as exc:
            last = exc
    raise ShardingError(str(last) if last else f"no nodes to split {card.id} over")


def replace_lost_shards(
    instance: Instance, gone: Collection[str], nodes: list[NodeInfo], card: ModelCard,
    busy: Collection[str] = (),
) -> Instance:
    """The instance with each shard of a dead node (`gone`) on a live node that is in no group
    (not this one, not `busy`), has a ring address and the memory for the shard's layers:
    the roomiest first. Ranks and layers stay; every rank then restarts into the new ring.
    `nodes` are the live ones able to serve the model. Pure."""
    members = {s.node_id for s in instance.shards}
    free = {
        n.node_id: n for n in nodes
        if n.ring_address and n.node_id not in members and n.node_id not in busy
    }
    shards = []
    for shard in instance.shards:
        if shard.node_id not in gone:
            shards.append(shard)
            continue
        need = rank_bytes(card, shard.end_layer - shard.start_layer)
        able = [n for n in free.values() if n.memory_available_bytes >= need]
        if not able:
            raise ShardingError(
                f"no live node can take rank {shard.rank} of {instance.instance_id} (layers "
                f"{shard.start_layer}-{shard.end_layer}, {need / 1e6:.0f} MB): every other "
                "node is in a group, has no ring address or too little memory"
            )
        target = max(able, key=lambda n: (n.memory_available_bytes, n.node_id))
        del free[target.node_id]
        shards.append(shard.model_copy(update={
            "node_id": target.node_id, "runner_id": "pending",
            "ring_address": target.ring_address,
        }))
    return instance.model_copy(update={"shards": shards})
