"""The liveness rules (fleet.worker.liveness): tables, no server."""

from __future__ import annotations

import pytest

from fleet.wire.cluster import Instance, ModelCard, NodeInfo, ShardAssignment
from fleet.worker.liveness import (
    LinkHealth,
    Move,
    Placed,
    Stranded,
    beat_failed,
    beat_succeeded,
    dead_nodes,
    gap_seen,
    plan_moves,
    trusts_absences,
)

TTL, BEAT = 15.0, 3.0


def history(*steps: tuple[str, float]) -> LinkHealth:
    health = LinkHealth()
    for kind, at in steps:
        if kind == "ok":
            health = beat_succeeded(health, at)
        else:
            health = beat_failed(health) if kind == "fail" else gap_seen(health)
    return health


@pytest.mark.parametrize(("steps", "now", "trusted"), [
    ((), 100.0, False),  # never reached the KV
    ((("ok", 0.0),), 10.0, False),  # up for less than a TTL (a fresh start)
    ((("ok", 0.0), ("ok", 3.0), ("ok", 15.0)), 15.0, True),  # a full TTL of good beats
    ((("ok", 0.0), ("ok", 14.0)), 20.0, True),  # last good beat 6 s ago: still fresh
    ((("ok", 0.0), ("ok", 3.0)), 15.0, False),  # silent for 12 s: our own beats stalled
    ((("ok", 0.0), ("fail", 5.0), ("ok", 25.0)), 30.0, False),  # back 5 s after a gap
    ((("ok", 0.0), ("fail", 5.0), ("ok", 25.0), ("ok", 40.0)), 40.0, True),  # back a full TTL
    ((("ok", 0.0), ("ok", 30.0), ("fail", 33.0)), 33.0, False),  # failing right now
    ((("ok", 0.0), ("gap", 14.0), ("ok", 15.0)), 16.0, False),  # a watch gap restarts the clock
    ((("ok", 0.0), ("gap", 1.0), ("ok", 3.0), ("ok", 18.0)), 18.0, True),
])
def test_absences_are_evidence_only_after_a_full_ttl_of_good_heartbeats(
    steps: tuple[tuple[str, float], ...], now: float, trusted: bool
) -> None:
    assert trusts_absences(history(*steps), now, TTL, BEAT) is trusted


@pytest.mark.parametrize(("placed_on", "alive", "trusted", "dead"), [
    (["a", "b"], ["a"], True, {"b"}),
    (["a", "b"], ["a"], False, set()),  # no evidence: nobody is dead
    (["me"], [], True, set()),  # our own key gone is never our own death
    (["me", "b"], ["b"], True, set()),
    (["a"], ["a"], True, set()),
])
def test_dead_nodes(placed_on: list[str], alive: list[str], trusted: bool, dead: set[str]) -> None:
    assert dead_nodes(placed_on, alive, "me", trusted) == dead


def node(node_id: str, models: list[str], at: float = 100.0, free: int = 8 << 30) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, started_at=0.0, at=at, models_available=models,
        memory_available_bytes=free, memory_total_bytes=16 << 30, cpu_count=2,
    )


def instance(instance_id: str, on: str, model: str = "m") -> Placed:
    shard = ShardAssignment(node_id=on, runner_id="r1", end_layer=1)
    return Placed(Instance(instance_id=instance_id, model=model, slots=4, created_at=0.0,
                           shards=[shard]), revision=7)


CARDS = {"m": ModelCard(id="m", name="m", tasks=["text_generation"], family="llama",
                        source="x", size_bytes=1 << 20)}


def summary(decisions: list[Move | Stranded]) -> list[tuple[str, str, str]]:
    return [
        (d.instance_id, "->", d.target) if isinstance(d, Move) else (d.instance_id, "stuck", "")
        for d in decisions
    ]


@pytest.mark.parametrize(("placed", "nodes", "trusted", "expected"), [
    # A dead node's instance goes to a live node that has the model.
    ([instance("i1", "gone")], [node("me", ["m"])], True, [("i1", "->", "me")]),
    # Not without evidence.
    ([instance("i1", "gone")], [node("me", ["m"])], False, []),
    # Our own instance stays even when our own key is missing from the reading.
    ([instance("i1", "me")], [node("b", ["m"])], True, []),
    # Live nodes keep theirs.
    ([instance("i1", "b")], [node("me", ["m"]), node("b", ["m"])], True, []),
    # No live node can provide the model: stranded, it waits.
    ([instance("i1", "gone")], [node("me", [])], True, [("i1", "stuck", "")]),
    # A stale heartbeat value is no candidate.
    ([instance("i1", "gone")], [node("b", ["m"], at=0.0)], True, [("i1", "stuck", "")]),
    # The moves of one sweep count the memory of those before them: spread, not piled on the
    # node with the most free memory as the heartbeats said.
    ([instance("i1", "gone"), instance("i2", "gone")],
     [node("a", ["m"], free=3 << 20), node("b", ["m"], free=(2 << 20) + 1)], True,
     [("i1", "->", "a"), ("i2", "->", "b")]),
    # ... and a node filled by them takes no more: the next waits.
    ([instance("i1", "gone"), instance("i2", "gone")], [node("a", ["m"], free=3 << 19)], True,
     [("i1", "->", "a"), ("i2", "stuck", "")]),
])
def test_plan_moves(
    placed: list[Placed], nodes: list[NodeInfo], trusted: bool,
    expected: list[tuple[str, str, str]],
) -> None:
    assert summary(plan_moves(placed, nodes, "me", trusted, CARDS, now=101.0)) == expected


def test_a_move_keeps_the_revision_for_its_compare_and_set_and_resets_the_runner() -> None:
    [move] = plan_moves([instance("i1", "gone")], [node("me", ["m"])], "me", True, CARDS, 101.0)
    assert isinstance(move, Move) and move.revision == 7 and move.gone == ("gone",)
    assert [(s.node_id, s.runner_id) for s in move.instance.shards] == [("me", "pending")]
