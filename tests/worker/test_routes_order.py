"""The order `routes` reads waiting tasks in: by class, then arrival, whether sorted afresh
or read from the tasks last sorted (fleet.worker.routes._in_order). A table of pending
dicts in sequence, each against the order a stable sort of its own gives."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from fleet.priorities import RANK
from fleet.wire.tasks import Priority, TextGeneration
from fleet.worker.routes import _ORDER_MEMO, routes
from fleet.worker.state import PendingTask, WorkerState

NOW = 1000.0


def waiting(task_id: str, at: float, priority: Priority = "default") -> PendingTask:
    return PendingTask(TextGeneration(task_id=task_id, model="m", prompt="hi",
                                      priority=priority), NOW + at, inputs={})


A, B, C = waiting("a", 1), waiting("b", 2), waiting("c", 3)
D, E = waiting("d", 4), waiting("e", 5)
EARLY = waiting("early", 0.5)  # arrives after the others, received before them
E_TIE = waiting("e-tie", 5)  # arrives with e
A_LATER = waiting("a", 6)  # a, queued again after it left
INTER = waiting("i", 4, "interactive")
TIE = waiting("tie", 2)  # arrives with b
B_AGAIN = waiting("b", 2)  # b's record made anew (equal, not the same)


def sorted_afresh(pending: Mapping[str, PendingTask]) -> list[str]:
    return [task_id for task_id, _ in sorted(
        pending.items(), key=lambda kv: (RANK[kv[1].task.priority], kv[1].received_at))]


@pytest.mark.parametrize("steps", [
    pytest.param([{"c": C, "a": A, "b": B}, {"c": C, "b": B}, {"c": C}, {}],
                 id="dispatched-one-by-one"),
    pytest.param([{"a": A, "b": B, "c": C}, {"a": A, "c": C}, {"c": C, "a": A, "i": INTER}],
                 id="a-task-arrives"),
    pytest.param([{"a": A, "b": B, "c": C}, {"a": A, "c": C}, {"a": A, "c": C, "b": B}],
                 id="the-same-record-queued-again"),
    pytest.param([{"a": A, "b": B, "c": C}, {"a": A, "b": B_AGAIN, "c": C}],
                 id="a-record-made-anew"),
    pytest.param([{"tie": TIE, "b": B, "a": A}, {"b": B, "a": A}, {"b": B, "a": A, "tie": TIE},
                  {"a": A, "tie": TIE}], id="a-tie-keeps-each-dicts-order"),
    pytest.param([{"i": INTER, "a": A}, {"a": A, "i": INTER}, {"a": A}], id="class-first"),
    pytest.param([{"a": A, "b": B, "c": C}, {"c": C}, {"c": C, "b": B}],
                 id="fewer-than-half-left-sorted-afresh"),
    # tasks arriving besides some of those sorted: after them, or all sorted afresh
    pytest.param([{"a": A, "b": B, "c": C}, {"b": B, "c": C}, {"b": B, "e": E, "c": C, "d": D},
                  {"c": C, "d": D, "e": E}], id="a-batch-arrives-after-those-waiting"),
    pytest.param([{"a": A, "b": B, "c": C}, {"b": B, "c": C}, {"b": B, "c": C, "early": EARLY}],
                 id="an-arrival-sorts-before-those-waiting"),
    pytest.param([{"a": A, "b": B}, {"b": B, "c": C, "i": INTER}],
                 id="an-interactive-arrival-goes-first"),
    pytest.param([{"a": A, "b": B}, {"b": B, "e-tie": E_TIE, "e": E}, {"e": E, "e-tie": E_TIE}],
                 id="two-arrivals-tie-each-dicts-order"),
    pytest.param([{"b": B, "c": C, "d": D}, {"a": A, "b": B, "c": C, "d": D}],
                 id="an-arrival-older-than-all"),
    pytest.param([{"a": A, "b": B, "c": C}, {"b": B, "c": C}, {"b": B, "c": C, "d": D},
                  {"c": C, "d": D, "a": A_LATER}], id="a-task-leaves-and-comes-back"),
    pytest.param([{"a": A, "b": B, "c": C, "d": D}, {"d": D, "e": E}, {"e": E}],
                 id="arrivals-where-fewer-than-half-are-left"),
    pytest.param([{"a": A, "b": B}, {"b": B_AGAIN, "c": C}],
                 id="an-arrival-and-a-record-made-anew"),
])
def test_routes_reads_waiting_tasks_as_a_sort_of_them_would(
        steps: list[dict[str, PendingTask]]) -> None:
    _ORDER_MEMO.last = None
    for pending in steps:
        state = WorkerState(node_id="n", pending=pending)
        for _ in range(2):  # the same dict again: read from the memo
            assert [task_id for task_id, _, _ in routes(state, NOW)] == sorted_afresh(pending)

