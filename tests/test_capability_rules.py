"""What a gateway hears of the nodes (issue 22), the pure part: the record the sweeper keeps
per live node, when it is rewritten, which records go, and which a gateway counts alive
(fleet.capability_rules). Table tests."""

from __future__ import annotations

import pytest

from fleet.capability_rules import (
    MEMORY_STEP,
    capabilities_of,
    live_records,
    plan_changes,
    worth_writing,
)
from fleet.gateway.catalogue import unavailable_reason
from fleet.models.catalog import get_card
from fleet.placement_rules import HEARTBEAT_STALE_S
from fleet.wire.cluster import CapabilitiesKeeper, NodeCapabilities, NodeInfo

GB = 1 << 30
NOW = 1000.0


def beat(node_id: str = "a", **more: object) -> NodeInfo:
    fields = {
        "node_id": node_id, "hostname": node_id, "memory_total_bytes": 64 * GB,
        "memory_available_bytes": 16 * GB, "cpu_count": 2, "models_available": ["tiny-llm"],
        "started_at": 0.0, "at": NOW, **more,
    }
    return NodeInfo.model_validate(fields)


def record(node_id: str = "a", **more: object) -> NodeCapabilities:
    return capabilities_of(beat(node_id, **more))


STEP = int(MEMORY_STEP * 64 * GB)


@pytest.mark.parametrize(
    ("written", "current", "write"),
    [
        (None, record(), True),  # a new node
        (record(), record(), False),
        # what changes at every beat is not in the record at all
        (record(), capabilities_of(beat(at=NOW + 3, held_acks=["$JS.ACK.x"],
                                        runners=["r1"], standby_runner=True)), False),
        (record(), record(memory_available_bytes=16 * GB - STEP), False),  # a small move
        (record(), record(memory_available_bytes=16 * GB + STEP + 1), True),
        (record(), record(memory_available_bytes=16 * GB - STEP - 1), True),
        (record(), record(models_available=["tiny-llm", "tiny-vlm"]), True),
        (record(), record(models_on_disk=["tiny-llm"]), True),
        (record(), record(models_disk_room_bytes=0), True),
        (record(), record(ring_address="a:1"), True),
        (record(), record(started_at=5.0), True),  # restarted
        # a small move of memory beside another change: written, memory with it
        (record(), record(memory_available_bytes=16 * GB - 1, ring_address="a:1"), True),
    ],
)
def test_worth_writing(written: NodeCapabilities | None, current: NodeCapabilities,
                       write: bool) -> None:
    assert worth_writing(written, current) is write


@pytest.mark.parametrize(
    ("current", "written", "trusted", "declared", "puts", "deletes"),
    [
        ({"a": record("a")}, {}, True, (), {"a"}, ()),  # a node starts
        ({"a": record("a")}, {"a": record("a")}, True, (), set(), ()),  # beats: nothing
        ({}, {"a": record("a")}, True, (), set(), ("a",)),  # its key went: gone
        # an absent key is no evidence yet (a sweeper that just took over, a gap): kept
        ({}, {"a": record("a")}, False, (), set(), ()),
        ({}, {"a": record("a")}, False, ("a",), set(), ("a",)),  # the death watch saw it
        # a takeover: a node born and one dead while no sweeper ran
        ({"b": record("b")}, {"a": record("a")}, True, (), {"b"}, ("a",)),
        ({"a": record("a", models_available=[])}, {"a": record("a")}, False, (), {"a"}, ()),
    ],
)
def test_plan_changes(current: dict[str, NodeCapabilities],
                      written: dict[str, NodeCapabilities], trusted: bool,
                      declared: tuple[str, ...], puts: set[str],
                      deletes: tuple[str, ...]) -> None:
    changes = plan_changes(current, written, trusted=trusted, declared=declared)
    assert set(changes.puts) == puts
    assert changes.deletes == deletes


KEPT = CapabilitiesKeeper(node_id="s", at=NOW)


@pytest.mark.parametrize(
    ("records", "keeper", "now", "why"),
    [
        # the gateway's answers read from records, as they were from heartbeats
        ({"node.a": record("a")}, KEPT, NOW + 1, None),
        ({"node.a": record("a", models_available=["smollm2-135m"])}, KEPT, NOW + 1,
         "no live node can provide tiny-llm (a)"),
        ({"node.a": record("a", memory_available_bytes=10)}, KEPT, NOW + 1,
         "node a: 10 bytes of free"),
        ({"node.a": record("a", models_disk_room_bytes=0)}, KEPT, NOW + 1,
         "disk budget leaves"),
        ({}, KEPT, NOW + 1, "no worker is up"),
        # nobody keeps the records (no worker left): they say nothing once the mark is old
        ({"node.a": record("a")}, KEPT, NOW + HEARTBEAT_STALE_S, "no worker is up"),
        ({"node.a": record("a")}, None, NOW, "no worker is up"),  # never kept
        ({f"node.{n}": record(n, memory_available_bytes=300_000, ring_address=f"{n}:1")
          for n in "ab"}, KEPT, NOW + 1, None),  # split over two ringed nodes
    ],
)
def test_a_gateway_answers_from_the_records(
    records: dict[str, NodeCapabilities], keeper: CapabilitiesKeeper | None, now: float,
    why: str | None,
) -> None:
    found = unavailable_reason(get_card("tiny-llm"), live_records(records, keeper), False, now)
    assert found == why if why is None else why in (found or "")


def test_the_same_answer_as_from_the_heartbeat() -> None:
    """A record read back is the heartbeat as far as placement's rules look."""
    heartbeat = beat(models_on_disk=["tiny-llm"], models_disk_room_bytes=5 * GB,
                     ring_address="a:1", held_acks=["x"], runners=["r"])
    [read] = live_records({"node.a": capabilities_of(heartbeat)}, KEPT)
    looked_at = ("node_id", "memory_available_bytes", "memory_total_bytes", "models_on_disk",
                 "models_available", "models_disk_room_bytes", "ring_address", "at")
    assert {f: getattr(read, f) for f in looked_at} == {f: getattr(heartbeat, f)
                                                         for f in looked_at}
