"""Placing model instances, the choices: which node takes a model, how an instance is built,
where a lost node's shards go, what demand places. Pure: no broker, no clock (`now` comes in).
The writes that follow a choice (a KV compare-and-set of the instance) are fleet.placement's,
and the worker's duties' (fleet.worker.demand, fleet.worker.failover)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from fleet.batch_width import default_batch_width
from fleet.errors import InvalidRequest, PlacementError
from fleet.placement_shards import ShardingError, fewest_shards, rank_bytes
from fleet.wire.cluster import Instance, ModelCard, NodeInfo, ShardAssignment

HEARTBEAT_STALE_S = 30.0


def files_bytes(card: ModelCard) -> int:
    """What a node that lacks the model must store to serve it."""
    return card.manifest.total_bytes if card.manifest else card.size_bytes


def refusal(node: NodeInfo, card: ModelCard, now: float) -> str | None:
    """Why `node` cannot take the model, or None when it can. Pure."""
    if now - node.at >= HEARTBEAT_STALE_S:
        return f"silent for {now - node.at:.0f} s"
    if node.memory_available_bytes < card.size_bytes:
        return (f"{_mb(node.memory_available_bytes)} of free memory, the model needs "
                f"{_mb(card.size_bytes)}")
    room = node.models_disk_room_bytes
    if card.id not in node.models_on_disk and room is not None and room < files_bytes(card):
        return (f"its models disk budget leaves {_mb(room)} (--models-disk-limit), the files "
                f"need {_mb(files_bytes(card))}")
    return None


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size} bytes"


def choose_node(nodes: list[NodeInfo], card: ModelCard, now: float) -> NodeInfo:
    """The live node that can hold the model in memory and its files on disk: one that has
    its files first (no fetch), then the one with the most free memory (the key's TTL already
    dropped dead nodes; a stale `at` is a second guard). The error names each node's reason."""
    reasons = {n.node_id: refusal(n, card, now) for n in nodes}
    fitting = [n for n in nodes if reasons[n.node_id] is None]
    if not fitting:
        why = "; ".join(f"node {node}: {reason}" for node, reason in sorted(reasons.items()))
        raise PlacementError(
            f"no live node can hold {card.id}: {why}" if why
            else f"no live node can hold {card.id} (no worker is up); start `fleet worker`"
        )
    return max(
        fitting,
        key=lambda n: (card.id in n.models_on_disk, n.memory_available_bytes, n.node_id),
    )


def new_instance(
    card: ModelCard, node: NodeInfo, slots: int, now: float, instance_id: str | None = None
) -> Instance:
    return Instance(
        instance_id=instance_id or f"{card.id}-{uuid.uuid4().hex[:6]}",
        model=card.id,
        slots=slots if slots > 0 else default_batch_width(card, node.memory_available_bytes),
        created_at=now,
        shards=[ShardAssignment(
            node_id=node.node_id, runner_id="pending", end_layer=card.n_layers,
        )],
    )


def unprovided(card: ModelCard, nodes: list[NodeInfo]) -> str:
    names = ", ".join(sorted(n.node_id for n in nodes))
    return (
        f"no live node can provide {card.id} ({names}): its files are on no node's disk, no "
        "node can build it, and the fleet holds none of its files (`fleet models add`)"
    )


def candidates(nodes: list[NodeInfo], card: ModelCard, node_id: str | None) -> list[NodeInfo]:
    """The nodes a placement may choose from: the one asked for, else those that can provide
    the model (have, build or fetch its files). Pure."""
    if node_id:
        chosen = [n for n in nodes if n.node_id == node_id]
        if not chosen:
            raise InvalidRequest(f"node {node_id!r} is not alive")
        return chosen
    able = [n for n in nodes if card.id in n.models_available]
    if nodes and not able:
        raise PlacementError(unprovided(card, nodes))
    return able


def in_groups(instances: Iterable[Instance]) -> set[str]:
    """Nodes already running a shard of a sharded instance (one ring address each)."""
    return {s.node_id for i in instances if i.sharded for s in i.shards}


def able_to_shard(nodes: list[NodeInfo], card: ModelCard, now: float) -> list[NodeInfo]:
    """The nodes that could run a shard: alive, with disk room for the files (memory is
    the split's to weigh). Pure."""
    whole_memory = card.model_copy(update={"size_bytes": 0})
    return [n for n in nodes if refusal(n, whole_memory, now) is None]


def sharded_instance(
    card: ModelCard, shards: list[ShardAssignment], slots: int, now: float,
    instance_id: str | None = None,
) -> Instance:
    return Instance(
        instance_id=instance_id or f"{card.id}-{uuid.uuid4().hex[:6]}",
        model=card.id, slots=slots if slots > 0 else default_batch_width(card, 0),
        created_at=now, shards=shards,
    )


def moved(instance: Instance, gone: str, target: str) -> Instance:
    """The same instance with every shard of the node that left moved to `target`."""
    shards = [
        shard.model_copy(update={"node_id": target, "runner_id": "pending"})
        if shard.node_id == gone else shard
        for shard in instance.shards
    ]
    return instance.model_copy(update={"shards": shards})


def auto_instance_id(model: str) -> str:
    """The one instance demand places for a model: every worker that sees the demand
    proposes the same id, so the compare-and-set lets one of them write it."""
    return f"{model}-auto"


def demand_instance(
    able: list[NodeInfo], card: ModelCard, slots: int, busy: set[str], now: float
) -> Instance:
    """The instance demand places for `card` over the live nodes that can provide it: on one
    node when one can hold the model; else split over the fewest nodes that can, none of them
    `busy` running a shard already (PlacementError naming both reasons when neither works)."""
    instance_id = auto_instance_id(card.id)
    try:
        return new_instance(card, choose_node(able, card, now), slots, now, instance_id)
    except PlacementError as single:
        try:
            shards = fewest_shards(able_to_shard(able, card, now), card, busy)
        except ShardingError as split:
            raise PlacementError(f"{single}; split over nodes: {split}") from split
        return sharded_instance(card, shards, slots, now, instance_id)


def memory_placed_on(node_id: str, placed: Iterable[Instance],
                     cards: Mapping[str, ModelCard]) -> int:
    """What the shards placed on `node_id` take: each its layers and the weights every rank
    holds (fleet.placement_shards.rank_bytes); a whole model its size."""
    total = 0
    for instance in placed:
        shard = instance.shard_on(node_id)
        card = cards.get(instance.model)
        if shard is None or card is None:
            continue
        if instance.sharded and card.n_layers:
            total += rank_bytes(card, shard.end_layer - shard.start_layer)
        else:
            total += card.size_bytes
    return total


def models_placed_on(node_id: str, placed: Iterable[Instance]) -> set[str]:
    return {i.model for i in placed if any(s.node_id == node_id for s in i.shards)}
