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
])
def test_routes_reads_waiting_tasks_as_a_sort_of_them_would(
        steps: list[dict[str, PendingTask]]) -> None:
    _ORDER_MEMO.last = None
    for pending in steps:
        state = WorkerState(node_id="n", pending=pending)
        for _ in range(2):  # the same dict again: read from the memo
            assert [task_id for task_id, _, _ in routes(state, NOW)] == sorted_afresh(pending)
