"""Sharded placement: layers split by free memory over nodes that can join a ring (pure)."""

from __future__ import annotations

import pytest

from fleet.errors import InvalidRequest
from fleet.models.catalog import get_card
from fleet.placement_shards import ShardingError, choose_shards, fewest_shards, split_layers
from fleet.wire.cluster import NodeInfo

MB = 1_000_000


@pytest.mark.parametrize(
    ("n_layers", "free", "per_layer", "counts"),
    [
        (30, [100, 100], 1, [15, 15]),
        (30, [200, 100], 1, [20, 10]),
        (31, [100, 100], 1, [16, 15]),  # the rounding goes to the bigger share, then rank 0
        (2, [1000, 1], 1, [1, 1]),  # every node at least one layer
        (30, [300, 50], 10, [26, 4]),
        (10, [50, 60], 10, [5, 5]),  # 4.5 and 5.5 layers: each within what it holds
        (10, [100, 100, 100], 1, [4, 3, 3]),
        (4, [10, 30], 10, [1, 3]),  # exactly full
    ],
)
def test_split_layers(n_layers: int, free: list[int], per_layer: int, counts: list[int]) -> None:
    assert split_layers(n_layers, free, per_layer) == counts
    assert sum(counts) == n_layers


@pytest.mark.parametrize(
    ("n_layers", "free", "shared", "counts"),
    [
        (30, [300, 100], 0, [23, 7]),
        (30, [300, 100], 50, [25, 5]),  # what is left besides the shared weights decides
        (10, [110, 110], 60, [5, 5]),  # 50 left each: 5 layers each, the model just fits
    ],
)
def test_split_layers_leaves_every_rank_the_shared_weights(
    n_layers: int, free: list[int], shared: int, counts: list[int],
) -> None:
    assert split_layers(n_layers, free, 10, shared) == counts


@pytest.mark.parametrize(
    ("free", "shared", "error"),
    [
        ([110, 110], 61, "hold 8 of the 10 layers in their free memory, besides the"),
        ([200, 65], 60, "a node with 65 MB free cannot hold one layer"),
    ],
)
def test_split_layers_refuses_what_the_shared_weights_leave_no_room_for(
    free: list[int], shared: int, error: str,
) -> None:
    with pytest.raises(ShardingError, match=error):
        split_layers(10, [f * MB for f in free], 10 * MB, shared * MB)


@pytest.mark.parametrize(
    ("n_layers", "free", "per_layer", "error"),
    [
        (30, [100, 100], 10, "hold 20 of the 30 layers"),
        (1, [100, 100], 1, "cannot be split over 2"),
    ],
)
def test_split_layers_refuses(n_layers: int, free: list[int], per_layer: int, error: str) -> None:
    with pytest.raises(ShardingError, match=error):
        split_layers(n_layers, free, per_layer)


def _node(node_id: str, free_mb: int, ring: bool = True) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64_000 * MB,
        memory_available_bytes=free_mb * MB, cpu_count=2, started_at=0.0, at=0.0,
        ring_address=f"127.0.0.1:{5000 + ord(node_id[0])}" if ring else None,
    )


def test_choose_shards_gives_rank_0_the_first_layers_on_the_roomiest_node() -> None:
    card = get_card("smollm2-135m")  # 30 layers of 14.2 MB, and 113 MB every rank holds
    shards = choose_shards([_node("a", 300), _node("b", 600), _node("c", 100)], card, 2)
    assert [(s.node_id, s.rank, s.world_size, s.start_layer, s.end_layer) for s in shards] == [
        ("b", 0, 2, 0, 22), ("a", 1, 2, 22, 30),  # 487 and 187 MB left besides the 113
    ]
    assert shards[0].ring_address == "127.0.0.1:5098" and shards[1].ring_address.endswith("5097")


def test_choose_shards_skips_nodes_without_a_ring_or_in_a_group() -> None:
    card = get_card("tiny-llm")
    nodes = [_node("a", 10), _node("b", 10, ring=False), _node("c", 10)]
    assert [s.node_id for s in choose_shards(nodes, card, 2)] == ["a", "c"]
    with pytest.raises(ShardingError, match=r"need 2 live nodes.*1 can \(b, c"):
        choose_shards(nodes, card, 2, busy={"c"})
    with pytest.raises(ShardingError, match="2 layer"):
        choose_shards(nodes, card, 3)
    with pytest.raises(InvalidRequest):
        choose_shards(nodes, card, 1)


def test_fewest_shards_splits_a_model_no_node_holds() -> None:
    card = get_card("smollm2-135m")  # 14.2 MB a layer, 113 MB every rank holds
    two = fewest_shards([_node("a", 350), _node("b", 350), _node("c", 350)], card)
    assert [(s.node_id, s.start_layer, s.end_layer) for s in two] == [("a", 0, 15), ("b", 15, 30)]
    # 300 MB a node holds 13 layers besides the shared weights: two nodes are not enough.
    three = fewest_shards([_node("a", 300), _node("b", 300), _node("c", 300)], card)
    assert [s.end_layer - s.start_layer for s in three] == [10, 10, 10]
    with pytest.raises(ShardingError, match="hold"):
        fewest_shards([_node("a", 100), _node("b", 100)], card)


def test_a_lost_rank_moves_to_the_roomiest_free_node_and_keeps_its_layers() -> None:
    from fleet.placement import sharded_instance
    from fleet.placement_shards import replace_lost_shards

    card = get_card("smollm2-135m")
    shards = choose_shards([_node("a", 600), _node("b", 500)], card, 2)
    instance = sharded_instance(card, shards, 2, 0.0)
    live = [_node("a", 600), _node("c", 200), _node("d", 400), _node("e", 900, ring=False)]
    healed = replace_lost_shards(instance, {"b"}, live, card)
    assert [(s.node_id, s.rank, s.start_layer, s.end_layer, s.ring_address)
            for s in healed.shards] == [
        ("a", 0, 0, 17, "127.0.0.1:5097"), ("d", 1, 17, 30, "127.0.0.1:5100"),
    ]
    with pytest.raises(ShardingError, match="no live node can take rank 1"):
        # c is too small: 13 layers and the shared weights are 297 MB
        replace_lost_shards(instance, {"b"}, live, card, busy={"d"})
