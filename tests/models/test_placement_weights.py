"""Placement prefers nodes that hold the model's files, then the most free memory (pure)."""

from __future__ import annotations

import pytest

from fleet.errors import PlacementError
from fleet.models.catalog import get_card
from fleet.placement import choose_node
from fleet.wire.cluster import NodeInfo

NOW = 1000.0
GB = 1 << 30


def _node(
    node_id: str, free_gb: int, on_disk: tuple[str, ...] = (), room: int | None = None
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64 * GB,
        memory_available_bytes=free_gb * GB, cpu_count=2, models_on_disk=list(on_disk),
        models_disk_room_bytes=room, started_at=0.0, at=NOW,
    )


@pytest.mark.parametrize(
    ("nodes", "chosen"),
    [
        ([_node("a", 8), _node("b", 16)], "b"),  # nobody holds it: most free memory
        ([_node("a", 8, ("tiny-llm",)), _node("b", 16)], "a"),  # held beats memory
        ([_node("a", 8, ("tiny-llm",)), _node("b", 16, ("tiny-llm",))], "b"),
        ([_node("a", 8, ("smollm2-135m",)), _node("b", 16)], "b"),  # another model's files
        ([_node("a", 8), _node("b", 16, room=10)], "a"),  # b's disk budget leaves no room
        ([_node("a", 8), _node("b", 16, ("tiny-llm",), room=0)], "b"),  # b has the files
        ([_node("a", 8), _node("b", 16, room=GB)], "b"),  # room enough
    ],
)
def test_choose_node(nodes: list[NodeInfo], chosen: str) -> None:
    assert choose_node(nodes, get_card("tiny-llm"), NOW).node_id == chosen


def test_a_node_too_small_is_not_chosen_even_with_the_files() -> None:
    card = get_card("tiny-llm").model_copy(update={"size_bytes": 10 * GB})
    assert choose_node([_node("a", 8, ("tiny-llm",)), _node("b", 16)], card, NOW).node_id == "b"
    with pytest.raises(PlacementError):
        choose_node([_node("a", 8, ("tiny-llm",))], card, NOW)


def test_the_error_says_why_each_node_was_not_chosen() -> None:
    card = get_card("tiny-llm").model_copy(update={"size_bytes": 10 * GB})
    stale = _node("c", 64).model_copy(update={"at": NOW - 60})
    with pytest.raises(PlacementError) as refused:
        choose_node([_node("a", 8), _node("b", 16, room=1000), stale], card, NOW)
    message = str(refused.value)
    assert "node a: 8590 MB of free memory, the model needs 10737 MB" in message
    assert "node b: its models disk budget leaves 1000 bytes (--models-disk-limit)" in message
    assert "node c: silent for 60 s" in message
    with pytest.raises(PlacementError, match="no worker is up"):
        choose_node([], card, NOW)
