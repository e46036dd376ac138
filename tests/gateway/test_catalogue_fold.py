"""The catalogue decodes one heartbeat per change, not the whole node table (issue 22: at
N = 1,000 nodes a whole decode per beat was 333,000 decodes a second). Table test of
`_decoded`: the result equals a whole decode of the mirror after every kind of change. Since
the catalogue reads FLEET_CAPABILITIES instead, the same fold of its records and the
sweeper's keeper mark."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from fleet.bus.kv_mirror import Mirror
from fleet.capability_rules import capabilities_of
from fleet.gateway.catalogue import Catalogue, _decoded
from fleet.wire.cluster import CapabilitiesKeeper, Instance, NodeInfo, ShardAssignment
from fleet.wire.codec import encode

GB = 1 << 30


def beat(node_id: str, at: float = 1.0) -> bytes:
    return encode(NodeInfo.model_validate({
        "node_id": node_id, "hostname": node_id, "memory_total_bytes": 64 * GB,
        "memory_available_bytes": 16 * GB, "cpu_count": 2, "models_available": [],
        "started_at": 0.0, "at": at}))


@pytest.mark.parametrize(
    ("before", "after", "key"),
    [
        ({"a": beat("a")}, {"a": beat("a"), "b": beat("b")}, "b"),  # a node joins
        ({"a": beat("a"), "b": beat("b")}, {"a": beat("a", 2.0), "b": beat("b")}, "a"),  # beats
        ({"a": beat("a"), "b": beat("b")}, {"b": beat("b")}, "a"),  # a node's key expires
        ({"a": beat("a")}, {"a": b"not json"}, "a"),  # a value of another schema: dropped
        ({"a": beat("a")}, {"c": beat("c")}, None),  # the mirror replaced (a reconnect)
    ],
)
def test_one_change_decodes_as_the_whole_table_would(
    before: dict[str, bytes], after: dict[str, bytes], key: str | None
) -> None:
    mirror = Mirror("FLEET_NODES", lambda _key: None)
    mirror.values = dict(before)
    decoded = _decoded(mirror, NodeInfo)
    mirror.values = dict(after)
    assert _decoded(mirror, NodeInfo, decoded, key) == _decoded(mirror, NodeInfo)


def record(node_id: str) -> bytes:
    return encode(capabilities_of(NodeInfo.model_validate(orjson.loads(beat(node_id)))))


KEEPER = encode(CapabilitiesKeeper(node_id="s", at=100.0))


@pytest.mark.parametrize(
    ("steps", "nodes", "at"),
    [
        # (key, value or None: removed) in order; then the nodes the catalogue counts
        ([("node.a", record("a")), ("keeper", KEEPER)], {"a"}, 100.0),
        ([("node.a", record("a"))], set(), None),  # no keeper: nobody keeps them, no node
        ([("keeper", KEEPER), ("node.a", record("a")), ("node.b", record("b")),
          ("node.a", None)], {"b"}, 100.0),  # a node withdrawn by the sweeper
        ([("keeper", KEEPER), ("node.a", record("a")), ("keeper", None)], set(), None),
        ([("keeper", KEEPER), ("node.a", b"not json")], set(), None),  # dropped
        ([("keeper", KEEPER), ("written-by-worker", b"{}"), ("node.a", record("a"))], {"a"},
         100.0),  # a key of neither kind is left out
    ],
)
def test_the_capabilities_fold_one_change_at_a_time(
    tmp_path: Path, steps: list[tuple[str, bytes | None]], nodes: set[str], at: float | None,
) -> None:
    catalogue = Catalogue(tmp_path, connection=None)  # type: ignore[arg-type]
    mirror = catalogue._nodes
    _fold(mirror, catalogue._nodes_changed, steps)
    assert {n.node_id for n in catalogue.nodes} == nodes
    assert {n.at for n in catalogue.nodes} == ({at} if nodes else set())
    whole = Catalogue(tmp_path, connection=None)  # type: ignore[arg-type]
    whole._nodes.values = dict(mirror.values)
    whole._nodes_changed(None)  # a reconnect reads it whole: the same
    assert whole.nodes == catalogue.nodes


def instance(instance_id: str, model: str) -> bytes:
    return encode(Instance(instance_id=instance_id, model=model, slots=4, created_at=0.0,
                           shards=[ShardAssignment(node_id="n", runner_id="pending")]))


@pytest.mark.parametrize(
    ("steps", "placed"),
    [
        ([("i1", instance("i1", "m")), ("i2", instance("i2", "k"))], {"m", "k"}),
        ([("i1", instance("i1", "m")), ("i1", None)], set()),  # removed
        ([("i1", instance("i1", "m")), ("i2", instance("i2", "m")), ("i1", None)], {"m"}),
        ([("i1", instance("i1", "m")), ("i1", instance("i1", "k"))], {"k"}),  # replaced
        ([("i1", b"not json"), ("i2", instance("i2", "m"))], {"m"}),  # dropped
    ],
)
def test_the_instances_fold_one_change_at_a_time(
    tmp_path: Path, steps: list[tuple[str, bytes | None]], placed: set[str],
) -> None:
    """A change decodes one instance (a whole decode a change cost a gateway 58 % of a core
    at N = 1,000), and the result is what reading the table whole gives."""
    catalogue = Catalogue(tmp_path, connection=None)  # type: ignore[arg-type]
    mirror = catalogue._instances
    _fold(mirror, catalogue._instances_changed, steps)
    assert catalogue.placed == placed
    whole = Catalogue(tmp_path, connection=None)  # type: ignore[arg-type]
    whole._instances.values = dict(mirror.values)
    whole._instances_changed(None)
    assert (whole.placed, whole.instances) == (catalogue.placed, catalogue.instances)


def _fold(mirror: Mirror, changed: Callable[[str | None], None],
          steps: list[tuple[str, bytes | None]]) -> None:
    """The first (empty) load, then each step as the watch delivers it: one key changed."""
    changed(None)
    for key, value in steps:
        if value is None:
            mirror.values.pop(key, None)
        else:
            mirror.values[key] = value
        changed(key)
