"""The rules that read every waiting task (expire_pending, hand_back, fetch_inputs) answer
as they would read afresh when what they could find is kept from the tasks last read
(fleet.worker.plan._waiting): a table of pending dicts in sequence, each rule's answer
against its answer with nothing kept."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.tasks import TextGeneration
from fleet.worker import plan as rules
from fleet.worker import state as ev
from fleet.worker import state as state_module
from fleet.worker.preemption import Preempt, preempt
from fleet.worker.state import PendingTask, WorkerState, apply, evolve
from tests.worker.test_preemption import task as waiting_task
from tests.worker.test_preemption import world

NOW = 1000.0
HOSTED = Instance(instance_id="i", model="m", slots=1, created_at=0.0,
                  shards=[ShardAssignment(node_id="n", runner_id="r")])


def waiting(task_id: str, model: str = "m", deadline: float | None = None,
            inputs: dict[str, str] | None = None, **changes: object) -> PendingTask:
    task = TextGeneration(task_id=task_id, model=model, prompt="hi", deadline=(
        None if deadline is None else datetime.fromtimestamp(deadline, UTC)))
    return PendingTask(task, NOW, inputs=inputs, **changes)  # type: ignore[arg-type]


A, B, C = waiting("a", inputs={}), waiting("b", inputs={}), waiting("c", inputs={})
LATE = waiting("late", deadline=NOW - 1, inputs={})
SOON = waiting("soon", deadline=NOW + 60, inputs={})
UNFETCHED = waiting("u")
FETCHING = waiting("u", fetching=True)
ELSEWHERE = waiting("x", model="gone", inputs={})
OFFERED = waiting("x", model="gone", inputs={}, handing_off="n2")
B_FETCHING = waiting("b", inputs={}, fetching=True)  # b's record made anew, not equal


@pytest.mark.parametrize("steps", [
    pytest.param([{"a": A, "b": B, "c": C}, {"b": B, "c": C}, {"c": C, "late": LATE}],
                 id="a-late-task-arrives"),
    pytest.param([{"a": A, "soon": SOON, "c": C}, {"soon": SOON, "c": C}], id="a-deadline-ahead"),
    pytest.param([{"a": A, "late": LATE}, {"late": LATE}], id="late-all-along"),
    pytest.param([{"a": A, "u": UNFETCHED}, {"a": A, "u": FETCHING}, {"u": FETCHING}],
                 id="inputs-fetched"),
    pytest.param([{"a": A, "u": FETCHING, "b": B}, {"a": A, "u": UNFETCHED}],
                 id="an-unequal-record"),
    pytest.param([{"a": A, "x": OFFERED, "b": B}, {"a": A, "x": ELSEWHERE}],
                 id="an-offer-answered"),
    pytest.param([{"a": A, "x": ELSEWHERE, "b": B}, {"a": A, "x": ELSEWHERE}],
                 id="a-model-no-longer-served"),
    pytest.param([{"a": A, "b": B}, {"a": A, "b": B_FETCHING}, {"a": A}, {}],
                 id="fewer-than-half-and-none"),
    # tasks arriving besides some of those read: read alone, added to what was found
    pytest.param([{"a": A, "b": B, "c": C}, {"b": B, "c": C, "late": LATE}],
                 id="a-late-task-arrives-beside-those-read"),
    pytest.param([{"a": A, "late": LATE}, {"a": A, "b": B}, {"b": B, "c": C, "u": UNFETCHED}],
                 id="the-late-task-gone-then-one-unfetched-arrives"),
    pytest.param([{"a": A, "b": B}, {"a": A, "b": B, "x": ELSEWHERE}, {"b": B, "x": OFFERED}],
                 id="a-task-of-a-model-not-served-arrives-then-is-offered"),
    pytest.param([{"a": A, "u": UNFETCHED}, {"a": A, "u": FETCHING, "soon": SOON}],
                 id="an-arrival-and-an-unequal-record"),
    pytest.param([{"a": A, "b": B, "c": C}, {"late": LATE}, {"late": LATE, "a": A}],
                 id="an-arrival-where-fewer-than-half-are-left"),
])
def test_rules_reading_every_waiting_task_answer_as_read_afresh(
        steps: list[dict[str, PendingTask]]) -> None:
    state_module._WAITING_MEMO.last = None
    for pending in steps:
        state = WorkerState(node_id="n", instances={"i": HOSTED}, pending=pending)
        for rule in (rules.expire_pending, rules.hand_back, rules.fetch_inputs):
            kept = rule(state, NOW)
            memo = state_module._WAITING_MEMO.last
            state_module._WAITING_MEMO.last = None
            assert kept == rule(state, NOW), (rule.__name__, sorted(pending))
            state_module._WAITING_MEMO.last = memo


def test_preempt_answers_as_read_afresh() -> None:
    """A full runner's prefilling batch task, and waiting tasks as a drive changes them:
    preempt with the summary kept against preempt with nothing kept."""
    state_module._WAITING_MEMO.last = None
    full = world({"b": ("batch", False)}, {"c": "interactive", "w": "batch"})
    less_c = evolve(full, pending={"w": full.pending["w"]})
    again = apply(less_c, ev.TaskQueued(waiting_task("c2", "interactive")))
    answers = []
    for state in (full, less_c, full, again):
        kept = preempt(state, NOW)
        state_module._WAITING_MEMO.last = None
        assert kept == preempt(state, NOW)
        answers.append(kept)
    assert answers == [Preempt("b", "r"), None, Preempt("b", "r"), Preempt("b", "r")]
