"""Who hears which facts of the nodes, the pure part (issue 22): the record a gateway reads
of a live node (FLEET_CAPABILITIES), when the sweeper rewrites it, which records it deletes,
and which records a gateway counts alive. The writes are fleet.worker.capabilities'; the
reads fleet.gateway.catalogue's. No broker, no clock (`now` comes in)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fleet.wire.cluster import CapabilitiesKeeper, NodeCapabilities, NodeInfo

MEMORY_STEP = 0.02  # of the node's memory: a smaller move of free memory is not rewritten
KEEPER_S = 5.0  # the keeper's mark is rewritten this often


def capabilities_of(info: NodeInfo) -> NodeCapabilities:
    """The part of a heartbeat a gateway reads. Pure."""
    return NodeCapabilities(
        node_id=info.node_id, hostname=info.hostname,
        memory_total_bytes=info.memory_total_bytes,
        memory_available_bytes=info.memory_available_bytes, cpu_count=info.cpu_count,
        models_on_disk=info.models_on_disk, models_available=info.models_available,
        models_disk_room_bytes=info.models_disk_room_bytes, ring_address=info.ring_address,
        started_at=info.started_at,
    )


def worth_writing(written: NodeCapabilities | None, current: NodeCapabilities) -> bool:
    """Whether `current` differs from the record in the bucket by more than free memory's
    small moves. Pure."""
    if written is None:
        return True
    if written == current:
        return False
    if written.model_copy(update={"memory_available_bytes":
                                  current.memory_available_bytes}) != current:
        return True  # models, disk room, ring address, a restart: any change is written
    moved = abs(written.memory_available_bytes - current.memory_available_bytes)
    return moved > MEMORY_STEP * current.memory_total_bytes


@dataclass(frozen=True)
class Changes:
    puts: dict[str, NodeCapabilities] = field(default_factory=dict)  # by node id
    deletes: tuple[str, ...] = ()  # node ids


def plan_changes(
    current: Mapping[str, NodeCapabilities], written: Mapping[str, NodeCapabilities],
    *, trusted: bool, declared: Iterable[str] = (),
) -> Changes:
    """The writes that make the bucket (`written`) say what the live nodes' heartbeats
    (`current`, the dead less: `alive`) say. A record whose node has no heartbeat goes only
    while an absent key is evidence (`trusted`), or when the death watch saw the node die
    (`declared`). Pure."""
    puts = {node: record for node, record in current.items()
            if worth_writing(written.get(node), record)}
    dead = set(declared)
    deletes = tuple(sorted(node for node in written
                           if node not in current and (trusted or node in dead)))
    return Changes(puts, deletes)


def live_records(
    records: Mapping[str, NodeCapabilities], keeper: CapabilitiesKeeper | None,
) -> list[NodeInfo]:
    """The records as the heartbeats placement's rules take (fleet.placement_rules), each as
    fresh as the keeper's last mark: while the sweeper keeps them they are the live nodes;
    once its mark is older than HEARTBEAT_STALE_S (no worker left to keep them) the rules
    read every one as silent, as they read a heartbeat that old. No keeper: no node. Pure."""
    if keeper is None:
        return []
    return [as_node_info(record, keeper.at) for record in records.values()]


def as_node_info(record: NodeCapabilities, at: float) -> NodeInfo:
    """A record read as the heartbeat placement's rules take (at `at`; no runners, no acks)."""
    return NodeInfo.model_construct(  # validated as a NodeCapabilities already
        node_id=record.node_id, hostname=record.hostname,
        memory_total_bytes=record.memory_total_bytes,
        memory_available_bytes=record.memory_available_bytes, cpu_count=record.cpu_count,
        devices=[], models_on_disk=record.models_on_disk,
        models_available=record.models_available,
        models_disk_room_bytes=record.models_disk_room_bytes, runners=[],
        ring_address=record.ring_address, blas=None, standby_runner=False, held_acks=[],
        started_at=record.started_at, at=at, type="node_info", schema_version=1,
    )
