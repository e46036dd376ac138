"""The placement choices split from their KV writes (fleet.placement_rules, and the group
restart of fleet.worker.state): tables, no server. The writes themselves (a compare-and-set of
the instance) are tested where they happen (tests/worker/test_demand.py, integration)."""

from __future__ import annotations

import pytest

from fleet.errors import PlacementError
from fleet.models.catalog import get_card
from fleet.placement_rules import (
    demand_instance,
    memory_placed_on,
    models_placed_on,
    new_instance,
    sharded_instance,
)
from fleet.placement_shards import choose_shards, rank_bytes
from fleet.wire.cluster import Instance, NodeInfo
from fleet.worker.state import group_layout, regrouped

MB = 1_000_000
SMOL = get_card("smollm2-135m")  # 30 layers of 14.2 MB and 113 MB every rank holds
TINY = get_card("tiny-llm")


def node(node_id: str, free_mb: int) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64_000 * MB,
        memory_available_bytes=free_mb * MB, cpu_count=2, started_at=0.0, at=0.0,
        ring_address=f"127.0.0.1:{5000 + ord(node_id[0])}",
    )


@pytest.mark.parametrize(
    ("free", "busy", "placed_on"),
    [
        ({"a": 600}, set(), ["a"]),  # one node holds it: no split
        ({"a": 600, "b": 900}, set(), ["b"]),  # the roomiest
        ({"a": 350, "b": 350}, set(), ["a", "b"]),  # neither alone: the fewest that can
        ({"a": 350, "b": 350, "c": 350}, {"a"}, ["b", "c"]),  # a runs a shard already
        ({"a": 300, "b": 300, "c": 300}, set(), ["a", "b", "c"]),
    ],
)
def test_demand_places_one_node_else_the_fewest_shards(
    free: dict[str, int], busy: set[str], placed_on: list[str]
) -> None:
    able = [node(n, mb) for n, mb in free.items()]
    instance = demand_instance(able, SMOL, 4, busy, 0.0)
    assert instance.instance_id == "smollm2-135m-auto"  # every worker proposes the same id
    assert [s.node_id for s in instance.shards] == placed_on
    assert instance.sharded == (len(placed_on) > 1)


@pytest.mark.parametrize(
    ("free", "error"),
    [
        ({"a": 100, "b": 100}, r"no live node can hold smollm2-135m.*split over nodes"),
        ({}, "no worker is up"),
    ],
)
def test_demand_that_nothing_can_hold_names_both_reasons(free: dict[str, int], error: str) -> None:
    with pytest.raises(PlacementError, match=error):
        demand_instance([node(n, mb) for n, mb in free.items()], SMOL, 4, set(), 0.0)


def test_what_is_placed_on_a_node() -> None:
    whole = new_instance(TINY, node("a", 100), 4, 0.0, "tiny-1")
    split = sharded_instance(SMOL, choose_shards([node("a", 600), node("b", 500)], SMOL, 2),
                             4, 0.0, "smol-1")
    cards = {TINY.id: TINY, SMOL.id: SMOL}
    a_layers = split.shards[0].end_layer - split.shards[0].start_layer
    cases = [
        # (node, instances, memory, models)
        ("a", [whole], TINY.size_bytes, {TINY.id}),
        ("b", [whole], 0, set()),
        ("a", [whole, split], TINY.size_bytes + rank_bytes(SMOL, a_layers), {TINY.id, SMOL.id}),
        ("b", [whole, split], rank_bytes(SMOL, 30 - a_layers), {SMOL.id}),
        ("c", [split], 0, set()),
    ]
    for node_id, placed, memory, models in cases:
        assert memory_placed_on(node_id, placed, cards) == memory, node_id
        assert models_placed_on(node_id, placed) == models, node_id
    assert memory_placed_on("a", [split], {}) == 0  # a card not known here weighs nothing


def _group(generation: int, b_address: str = "127.0.0.1:5098") -> Instance:
    split = sharded_instance(SMOL, choose_shards([node("a", 600), node("b", 500)], SMOL, 2),
                             4, 0.0, "smol-1")
    shards = [split.shards[0], split.shards[1].model_copy(update={"ring_address": b_address})]
    return split.model_copy(update={"generation": generation, "shards": shards})


@pytest.mark.parametrize(
    ("stored", "seen", "bumped_to"),
    [
        (_group(0), _group(0), 1),  # the group a rank died in: restart it
        (_group(3), _group(3), 4),
        (_group(1), _group(0), None),  # another rank's worker bumped it already
        (_group(0, "127.0.0.1:6000"), _group(0), None),  # a rank moved: restarts anyway
    ],
)
def test_a_dead_rank_regroups_only_the_layout_it_died_in(
    stored: Instance, seen: Instance, bumped_to: int | None
) -> None:
    bumped = regrouped(stored, group_layout(seen))
    assert (bumped.generation if bumped else None) == bumped_to
    if bumped is not None:
        assert bumped.shards == stored.shards


def test_the_pure_rooms_import_no_broker_code() -> None:
    """plan, liveness, state and the placement rules load neither nats-py nor fleet.bus (in
    a fresh interpreter: this one has both loaded already)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import fleet.placement_rules, fleet.worker.liveness, fleet.worker.plan, "
        "fleet.worker.state\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'nats' "
        "or m.startswith('fleet.bus')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
