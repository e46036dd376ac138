"""The priority rules as tables: clamp, order with starvation promotion, slack, preemption."""

from __future__ import annotations

import pytest

from fleet.priorities import clamp
from fleet.wire import subjects
from fleet.worker.priority import (
    PROMOTE_AFTER_S,
    Running,
    Turn,
    pull_order,
    quota,
    reserve_for,
    yields_to,
)

NOW = 1000.0
FRESH = {"interactive": NOW, "default": NOW, "batch": NOW}


@pytest.mark.parametrize(("asked", "ceiling", "gets"), [
    ("interactive", "interactive", "interactive"),
    ("interactive", "default", "default"),
    ("interactive", "batch", "batch"),
    ("default", "interactive", "default"),
    ("batch", "interactive", "batch"),
    ("default", "batch", "batch"),
])
def test_clamp_never_above_the_tenants_ceiling(asked: str, ceiling: str, gets: str) -> None:
    assert clamp(asked, ceiling) == gets  # type: ignore[arg-type]


@pytest.mark.parametrize(("served", "order"), [
    pytest.param(FRESH, ("interactive", "default", "batch"), id="in-rank-order"),
    pytest.param({**FRESH, "batch": NOW - PROMOTE_AFTER_S["batch"]},
                 ("interactive", "default", "batch"), id="batch-at-its-limit-not-yet"),
    pytest.param({**FRESH, "batch": NOW - PROMOTE_AFTER_S["batch"] - 1},
                 ("interactive", "batch*", "default"), id="starved-batch-one-place-up"),
    pytest.param({**FRESH, "default": NOW - PROMOTE_AFTER_S["default"] - 1},
                 ("default*", "interactive", "batch"), id="starved-default-one-place-up"),
    pytest.param({**FRESH, "interactive": NOW - 10_000},
                 ("interactive", "default", "batch"), id="interactive-is-never-promoted"),
    pytest.param({}, ("interactive", "default", "batch"), id="never-served-counts-from-now"),
])
def test_pull_order(served: dict[str, float], order: tuple[str, ...]) -> None:
    got = pull_order(served, NOW)
    assert tuple(t.priority + ("*" if t.promoted else "") for t in got) == order


@pytest.mark.parametrize(("turn", "free", "reserve", "takes"), [
    pytest.param(Turn("interactive"), 4, 1, 4, id="interactive-takes-every-free-slot"),
    pytest.param(Turn("default"), 4, 1, 4, id="default-takes-every-free-slot"),
    pytest.param(Turn("batch"), 4, 1, 3, id="batch-leaves-the-reserve"),
    pytest.param(Turn("batch"), 1, 1, 0, id="batch-never-takes-the-last-slot"),
    pytest.param(Turn("batch"), 1, 0, 1, id="single-slot-runner-has-no-reserve"),
    pytest.param(Turn("batch", promoted=True), 1, 1, 1, id="starved-batch-takes-one"),
    pytest.param(Turn("default", promoted=True), 4, 1, 1, id="promotion-is-for-one-task"),
    pytest.param(Turn("batch"), 0, 1, 0, id="nothing-free"),
])
def test_quota(turn: Turn, free: int, reserve: int, takes: int) -> None:
    assert quota(turn, free, reserve) == takes


@pytest.mark.parametrize(("slots", "reserve"), [(0, 0), (1, 0), (2, 1), (8, 1)])
def test_reserve(slots: int, reserve: int) -> None:
    assert reserve_for(slots) == reserve


def run(task_id: str, priority: str, sent: bool = False, at: float = 0.0) -> Running:
    return Running(task_id, priority, sent, at)  # type: ignore[arg-type]


@pytest.mark.parametrize(("running", "waiting", "victim"), [
    pytest.param([], "interactive", None, id="nothing-runs"),
    pytest.param([run("b", "batch")], "interactive", "b", id="unstarted-batch-yields"),
    pytest.param([run("b", "batch", sent=True)], "interactive", None,
                 id="a-task-whose-tokens-went-out-never-yields"),
    pytest.param([run("i", "interactive")], "interactive", None, id="same-class-never-yields"),
    pytest.param([run("d", "default"), run("b", "batch")], "interactive", "b",
                 id="lowest-class-first"),
    pytest.param([run("b1", "batch", at=1), run("b2", "batch", at=2)], "default", "b2",
                 id="newest-of-the-class-first"),
    pytest.param([run("d", "default")], "batch", None, id="batch-preempts-nothing"),
])
def test_yields_to(running: list[Running], waiting: str, victim: str | None) -> None:
    assert yields_to(running, waiting) == victim  # type: ignore[arg-type]


@pytest.mark.parametrize(("priority", "subject", "durable"), [
    ("default", "fleet.tasks.m-1", "tasks-m-1"),
    ("interactive", "fleet.tasks.m-1.interactive", "interactive-tasks-m-1"),
    ("batch", "fleet.tasks.m-1.batch", "batch-tasks-m-1"),
])
def test_class_subjects_and_durables(priority: str, subject: str, durable: str) -> None:
    assert subjects.model_of_durable("tasks-interactive-tasks-x") == "interactive-tasks-x"
    assert subjects.tasks("m-1", priority) == subject
    assert subjects.model_of_task_subject(subject) == "m-1"
    assert subjects.durable("m-1", priority) == durable
    assert subjects.model_of_durable(durable) == "m-1"
