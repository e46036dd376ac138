"""Who is declared dead, and when: the death watch's rules as tables (fleet.worker.deathwatch)."""

from __future__ import annotations

import pytest

from fleet.wire.cluster import NodeInfo
from fleet.worker.deathwatch import (
    CONFIRM_S,
    LINK_STABLE_S,
    MASS_CONFIRM_S,
    Absence,
    Probe,
    acks_to_nak,
    dead_nodes,
    observe,
    probe_period,
)
from fleet.worker.heartbeat import newly_held
from fleet.worker.liveness import dead_nodes as failover_dead
from fleet.worker.liveness import seen_dead

ACK = "$JS.ACK.FLEET_TASKS.tasks-tiny-llm.1.12.7.1733300000000000000.0"


@pytest.mark.parametrize(
    ("before", "probe", "after"),
    [
        (None, Probe.ANSWERED, None),
        (None, Probe.SILENT, None),  # loaded or paused: alive, AckWait guards it
        (None, Probe.NO_RESPONDERS, Absence(since=10.0)),
        (Absence(since=9.0), Probe.NO_RESPONDERS, Absence(since=9.0, count=2)),
        (Absence(since=9.0, count=3), Probe.SILENT, None),  # any sign of life clears it
        (Absence(since=9.0, count=3), Probe.ANSWERED, None),
    ],
)
def test_an_absence_is_only_no_responders_in_a_row(
    before: Absence | None, probe: Probe, after: Absence | None
) -> None:
    assert observe(before, probe, 10.0) == after


NOW = 100.0
STABLE = NOW - LINK_STABLE_S - 1  # the prober's link came up long ago
GONE = Absence(since=NOW - CONFIRM_S, count=3)


@pytest.mark.parametrize(
    ("case", "absences", "probed", "link_since", "dead"),
    [
        ("one node gone long enough", {"b": GONE}, 4, STABLE, {"b"}),
        ("gone, but too briefly", {"b": Absence(since=NOW - CONFIRM_S / 2, count=2)}, 4,
         STABLE, set()),
        ("gone for long, seen once only", {"b": Absence(since=NOW - 5, count=1)}, 4, STABLE,
         set()),
        ("the prober's own link is down", {"b": GONE}, 4, None, set()),
        ("the prober reconnected just now (a broker restart)", {"b": GONE}, 4,
         NOW - LINK_STABLE_S / 2, set()),
        ("counted from the prober's return", {"b": Absence(since=NOW - 60, count=99)}, 4,
         NOW - LINK_STABLE_S, {"b"}),
        ("never itself", {"a": GONE, "b": GONE}, 4, STABLE, {"b"}),
        ("most of the fleet at once: the broker, not deaths", {"b": GONE, "c": GONE, "d": GONE},
         4, STABLE, set()),
        ("most of the fleet gone for a heartbeat TTL",
         {n: Absence(since=NOW - MASS_CONFIRM_S, count=30) for n in "bcd"}, 4,
         NOW - MASS_CONFIRM_S, {"b", "c", "d"}),
        ("two of ten: not a mass absence", {"b": GONE, "c": GONE}, 10, STABLE, {"b", "c"}),
        ("the only probed node", {"b": GONE}, 1, STABLE, {"b"}),
    ],
)
def test_who_is_declared_dead(
    case: str, absences: dict[str, Absence], probed: int, link_since: float | None,
    dead: set[str],
) -> None:
    assert dead_nodes(absences, probed, NOW, link_since, "a") == dead, case


@pytest.mark.parametrize(
    ("held", "naked"),
    [
        ([ACK], [ACK]),
        # v2 form (domain and account hash)
        (["$JS.ACK.hub.acc.FLEET_TASKS.c.1.2.3.4.5"], ["$JS.ACK.hub.acc.FLEET_TASKS.c.1.2.3.4.5"]),
        (["$JS.ACK.FLEET_OUT.c.1.2.3.4.5"], []),  # another stream: a forged heartbeat
        (["$KV.FLEET_NODES.victim", "fleet.out.x", "_INBOX.worker.x", ""], []),
        (["$JS.ACK.FLEET_TASKS.*.1.2.3.4.5"], []),  # a wildcard
    ],
)
def test_only_task_acks_are_nakd(held: list[str], naked: list[str]) -> None:
    assert acks_to_nak(held) == naked


@pytest.mark.parametrize(
    ("held", "listed", "beat"),
    [
        ([], frozenset(), False),
        (["a"], frozenset(), True),
        (["a"], frozenset({"a"}), False),
        ([], frozenset({"a"}), False),  # ended since: harmless in the last beat
        (["a", "b"], frozenset({"a"}), True),
    ],
)
def test_a_new_held_message_is_listed_at_once(
    held: list[str], listed: frozenset[str], beat: bool
) -> None:
    assert newly_held(held, listed) is beat


def _node(node_id: str, at: float) -> NodeInfo:
    return NodeInfo(node_id=node_id, hostname="h", memory_total_bytes=1,
                    memory_available_bytes=1, cpu_count=1, started_at=0.0, at=at)


@pytest.mark.parametrize(
    ("declared", "live"),
    [
        ({}, {"a", "b"}),
        ({"b": 50.0}, {"a"}),  # seen dead after its last heartbeat: gone now
        ({"b": 10.0}, {"a", "b"}),  # a heartbeat since: restarted or back, alive
    ],
)
def test_a_node_seen_dead_is_gone_until_it_beats_again(
    declared: dict[str, float], live: set[str]
) -> None:
    nodes = [_node("a", 40.0), _node("b", 40.0)]
    assert {n.node_id for n in seen_dead(nodes, declared)} == live


@pytest.mark.parametrize(("targets", "period"), [(0, 0.5), (10, 0.5), (250, 0.5), (1000, 2.0)])
def test_a_larger_fleet_is_probed_less_often(targets: int, period: float) -> None:
    assert probe_period(targets) == period


@pytest.mark.parametrize(
    ("placed_on", "alive", "trusted", "seen_gone", "dead"),
    [
        (["a", "b"], ["a", "b"], True, ["b"], {"b"}),  # key not expired yet: seen gone
        (["a", "b"], ["a"], False, ["b"], {"b"}),  # the KV view untrusted: the watch's own
        (["a", "b"], ["a"], False, [], set()),  # no evidence at all
        (["me", "b"], ["b"], False, ["me"], set()),  # never itself
        (["a"], ["a"], True, ["z"], set()),  # seen gone but placed nowhere here
    ],
)
def test_a_node_seen_gone_is_dead_for_failover_whatever_the_kv_view(
    placed_on: list[str], alive: list[str], trusted: bool, seen_gone: list[str],
    dead: set[str],
) -> None:
    assert failover_dead(placed_on, alive, "me", trusted, seen_gone) == dead
