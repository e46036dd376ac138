"""Replicas spread over the nodes that can hold them; BLAS threads split a node's cores."""

from __future__ import annotations

import pytest

from fleet.errors import InvalidRequest, PlacementError
from fleet.models.catalog import get_card
from fleet.placement_replicas import choose_nodes
from fleet.wire.cluster import NodeInfo
from fleet.worker.runners import blas_threads

NOW = 1000.0
GB = 1 << 30


def _node(node_id: str, free_gb: float, on_disk: tuple[str, ...] = (), at: float = NOW) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, memory_total_bytes=64 * GB,
        memory_available_bytes=int(free_gb * GB), cpu_count=2, models_on_disk=list(on_disk),
        started_at=0.0, at=at,
    )


@pytest.mark.parametrize(
    ("nodes", "replicas", "chosen"),
    [
        ([_node("a", 8)], 3, ["a", "a", "a"]),  # one node: every replica there
        ([_node("a", 8), _node("b", 8)], 2, ["b", "a"]),  # equal nodes: one each
        ([_node("a", 8), _node("b", 8)], 4, ["b", "a", "b", "a"]),
        ([_node("a", 8, ("tiny-llm",)), _node("b", 16)], 2, ["a", "a"]),  # files beat memory
        ([_node("a", 8), _node("b", 16, at=NOW - 60)], 2, ["a", "a"]),  # stale node skipped
    ],
)
def test_choose_nodes(nodes: list[NodeInfo], replicas: int, chosen: list[str]) -> None:
    card = get_card("tiny-llm")
    assert [n.node_id for n in choose_nodes(nodes, card, replicas, NOW)] == chosen


def test_replicas_that_do_not_fit_are_refused() -> None:
    card = get_card("tiny-llm").model_copy(update={"size_bytes": 3 * GB})
    assert len(choose_nodes([_node("a", 7)], card, 2, NOW)) == 2
    with pytest.raises(PlacementError, match="replica 3"):
        choose_nodes([_node("a", 7)], card, 3, NOW)
    with pytest.raises(InvalidRequest):
        choose_nodes([_node("a", 7)], card, 0, NOW)


@pytest.mark.parametrize(
    ("cores", "runners", "configured", "threads"),
    [
        (2, 1, None, "2"),
        (2, 2, None, "1"),
        (2, 3, None, "1"),  # never zero
        (16, 4, None, "4"),
        (16, 4, "2", "2"),  # the operator's OPENBLAS_NUM_THREADS holds
    ],
)
def test_blas_threads(cores: int, runners: int, configured: str | None, threads: str) -> None:
    assert blas_threads(cores, runners, configured) == threads
