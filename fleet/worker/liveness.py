"""Deciding that a node is dead, only on evidence. Pure: time comes in as `now`.

A node's heartbeat key in FLEET_NODES expires one TTL after its last put. An absent key says
"dead" only if the node had working KV for a whole TTL and still did not beat; nobody can see
the node's side, so this worker judges by its own: while its own heartbeats fail (or its view
of the KV had a gap), every absence is suspect, its own above all. Once its own heartbeats
have gone through for a full TTL, and the latest one is fresh, an absent key is evidence: a
node that was only cut off by the same outage has had a TTL to beat again.

A worker never judges itself: its own expired key is re-registered by the next heartbeat, and
no rule here ever returns its own node as dead. That is what kept a 20 s loss of the KV leader
from moving a live worker's instance away and stopping its runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from fleet.errors import FleetError
from fleet.placement_rules import able_to_shard, choose_node, in_groups, moved
from fleet.placement_shards import ShardingError, replace_lost_shards
from fleet.wire.cluster import Instance, ModelCard, NodeInfo

# A heartbeat is "fresh" when the last good one is at most this many periods old.
FRESH_BEATS = 2.5


@dataclass(frozen=True)
class LinkHealth:
    """This worker's own round trips to the KV (times are time.monotonic())."""

    ok_since: float | None = None  # the first success after the last failure or gap
    last_ok: float | None = None
    failures: int = 0  # failed rounds since the last success (for logs)


def beat_succeeded(health: LinkHealth, now: float) -> LinkHealth:
    since = health.ok_since if health.ok_since is not None else now
    return LinkHealth(ok_since=since, last_ok=now, failures=0)


def beat_failed(health: LinkHealth) -> LinkHealth:
    """A failed heartbeat or a disconnect: what was learnt before is stale."""
    return replace(health, ok_since=None, failures=health.failures + 1)


def gap_seen(health: LinkHealth) -> LinkHealth:
    """A reconnect or a restarted watch: stale as well, though no heartbeat failed."""
    return replace(health, ok_since=None)


def trusts_absences(health: LinkHealth, now: float, ttl_s: float, beat_s: float) -> bool:
    """True when an absent heartbeat key is evidence that its node is dead."""
    if health.ok_since is None or health.last_ok is None:
        return False
    return now - health.ok_since >= ttl_s and now - health.last_ok <= FRESH_BEATS * beat_s


def dead_nodes(
    placed_on: Iterable[str], alive: Iterable[str], self_id: str, trusted: bool,
    seen_gone: Iterable[str] = (),
) -> set[str]:
    """The nodes among `placed_on` to treat as dead: absent from `alive` (when absences are
    trusted), or `seen_gone` by the death watch (its own evidence, whatever the KV view),
    never this one."""
    gone = set(seen_gone)
    alive_set = set(alive)
    return {node for node in placed_on if node != self_id
            and (node in gone or (trusted and node not in alive_set))}


def seen_dead(
    nodes: Iterable[NodeInfo], declared: dict[str, float]
) -> list[NodeInfo]:
    """Pure. `nodes` less those the death watch declared dead (fleet.worker.deathwatch) at a
    wall time `declared[node]` later than their last heartbeat: a dead process writes none,
    so a heartbeat written since says the node (restarted, or reconnected) lives."""
    return [node for node in nodes
            if node.node_id not in declared or node.at > declared[node.node_id]]


@dataclass(frozen=True)
class Placed:
    """An instance as read from the bucket, with the revision a compare-and-set needs."""

    instance: Instance
    revision: int


@dataclass(frozen=True)
class Move:
    instance_id: str
    revision: int
    gone: tuple[str, ...]
    target: str
    instance: Instance  # the instance as it is to be written


@dataclass(frozen=True)
class Stranded:
    """Its nodes are dead and no live node can serve it: it waits, logged once."""

    instance_id: str
    gone: tuple[str, ...]
    why: str


def plan_moves(
    placed: Iterable[Placed],
    nodes: Iterable[NodeInfo],
    self_id: str,
    trusted: bool,
    cards: dict[str, ModelCard],
    now: float,
    seen_gone: Iterable[str] = (),
) -> list[Move | Stranded]:
    """For every instance with a shard on a dead node, where to move it (or why it cannot
    move). `nodes` are the live heartbeats as just read; `now` is wall time for their `at`."""
    live = {node.node_id: node for node in nodes}
    out: list[Move | Stranded] = []
    placed = list(placed)
    for item in placed:
        instance = item.instance
        shard_nodes = [shard.node_id for shard in instance.shards]
        gone = tuple(sorted(dead_nodes(shard_nodes, live, self_id, trusted, seen_gone)))
        if not gone:
            continue
        card = cards.get(instance.model) or unknown_card(instance.model)
        candidates = [
            node for node in live.values()
            if node.node_id not in gone and instance.model in node.models_available
        ]
        if instance.sharded:
            out.append(_move_shards(item, gone, candidates, card, placed, now))
            continue
        try:
            target = choose_node(candidates, card, now)
        except FleetError as exc:
            out.append(Stranded(instance.instance_id, gone, str(exc)))
            continue
        # The memory this move takes, counted for the moves after it in the same sweep: the
        # heartbeats were read once, and every instance of a dead node (N = 1,000 in the scale
        # bench: 127 in one sweep) went to the one node with the most free memory.
        live[target.node_id] = target.model_copy(update={
            "memory_available_bytes": max(0, target.memory_available_bytes - card.size_bytes)})
        moved_instance = instance
        for node in gone:
            moved_instance = moved(moved_instance, node, target.node_id)
        out.append(Move(instance.instance_id, item.revision, gone, target.node_id, moved_instance))
    return out


def _move_shards(
    item: Placed, gone: tuple[str, ...], candidates: list[NodeInfo], card: ModelCard,
    placed: list[Placed], now: float,
) -> Move | Stranded:
    """A sharded instance's lost ranks go to live nodes in no group; the others stay."""
    instance = item.instance
    busy = in_groups(p.instance for p in placed if p.instance.instance_id != instance.instance_id)
    try:
        moved_instance = replace_lost_shards(
            instance, gone, able_to_shard(candidates, card, now), card, busy
        )
    except ShardingError as exc:
        return Stranded(instance.instance_id, gone, str(exc))
    targets = ",".join(s.node_id for s in moved_instance.shards if s not in instance.shards)
    return Move(instance.instance_id, item.revision, gone, targets, moved_instance)


def unknown_card(model: str) -> ModelCard:
    return ModelCard(id=model, name=model, tasks=["text_generation"], family="unknown",
                     source="unknown")
