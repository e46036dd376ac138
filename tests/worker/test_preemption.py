"""The preemption rules as tables (fleet.worker.preemption): who yields its slot to a waiting
interactive task, when one is pulled although no slot is free, and what dispatch takes first."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest

from fleet.aio import Supervisor
from fleet.runner.engine import Admission, EngineConfig
from fleet.runner.fault_engine import FaultEngine, fault_card
from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.events import TaskFinished
from fleet.wire.runners import RunnerReady
from fleet.wire.tasks import ChatMessage, Priority, TextGeneration
from fleet.worker import state as ev
from fleet.worker.acks import Stage
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import Inbox, RunnerReported
from fleet.worker.plan import Dispatch, EndProbe, Pull, plan
from fleet.worker.plan import pull as plan_pull
from fleet.worker.preemption import Preempt, preempt, pull_to_preempt
from fleet.worker.reports import RunnerReports
from fleet.worker.spans import TaskSpans
from fleet.worker.state import PendingTask, RunnerView, WorkerState, apply
from tests.runner.test_fault_rate import FakeClock
from tests.worker.test_image_outputs import Store
from tests.worker.test_reports import Cluster, Desk, Intake, Output, Runners

MODEL = "m"
NOW = 1000.0


def task(task_id: str, priority: Priority) -> PendingTask:
    return PendingTask(
        task=TextGeneration(task_id=task_id, model=MODEL, priority=priority,
                            messages=[ChatMessage(role="user", content="hi")]),
        received_at=NOW - 10 + len(task_id), inputs={},
    )


def world(running: dict[str, tuple[Priority, bool]], waiting: dict[str, Priority],
          slots: int = 1, **changes: object) -> WorkerState:
    """One runner of `slots`; `running`: task -> (class, first token sent); `waiting`: tasks
    queued here, ready to run."""
    hosted = Instance(instance_id="i", model=MODEL, slots=slots, created_at=0.0,
                      shards=[ShardAssignment(node_id="n", runner_id="r")])
    state = WorkerState(node_id="n", instances={"i": hosted}, runners={"r": RunnerView(
        runner_id="r", instance_id="i", model=MODEL, status=RunnerReady(), slots=slots)})
    for task_id, (priority, sent) in running.items():
        state = apply(state, ev.TaskQueued(task(task_id, priority)))
        state = apply(state, ev.TaskDispatched(task_id, "r"))
        if sent:
            state = apply(state, ev.FirstOutput(task_id, "r"))
    for task_id, priority in waiting.items():
        state = apply(state, ev.TaskQueued(task(task_id, priority)))
    return replace(state, **changes)


@pytest.mark.parametrize(("running", "waiting", "slots", "victim"), [
    pytest.param({"b": ("batch", False)}, {"c": "interactive"}, 1, "b",
                 id="prefilling-batch-yields"),
    pytest.param({"d": ("default", False)}, {"c": "interactive"}, 1, "d",
                 id="prefilling-default-yields"),
    pytest.param({"b": ("batch", True)}, {"c": "interactive"}, 1, None,
                 id="a-task-that-sent-a-token-never-yields"),
    pytest.param({"i": ("interactive", False)}, {"c": "interactive"}, 1, None,
                 id="same-class-never-yields"),
    pytest.param({"b": ("batch", False)}, {"d": "default"}, 1, None,
                 id="only-interactive-preempts"),
    pytest.param({"b": ("batch", False)}, {}, 1, None, id="nothing-waits"),
    pytest.param({"b": ("batch", False)}, {"c": "interactive"}, 2, None,
                 id="a-free-slot-takes-it-instead"),
    pytest.param({"d": ("default", False), "bb": ("batch", False)}, {"c": "interactive"}, 2,
                 "bb", id="lowest-class-first"),
    pytest.param({"b1": ("batch", False), "b22": ("batch", False)}, {"c": "interactive"}, 2,
                 "b22", id="within-a-class-the-newest"),
])
def test_preempt(running: dict[str, tuple[Priority, bool]], waiting: dict[str, Priority],
                 slots: int, victim: str | None) -> None:
    got = preempt(world(running, waiting, slots), NOW)
    assert got == (Preempt(victim, "r") if victim else None)


def test_one_task_yields_per_waiting_interactive_task() -> None:
    state = world({"b1": ("batch", False), "b22": ("batch", False)}, {"c": "interactive"},
                  slots=2)
    state = apply(state, ev.CancelNoted("b22", ev.CancelOrigin.PREEMPTED))
    assert preempt(state, NOW) is None  # b22 is yielding already: b1 keeps its slot
    state = apply(state, ev.TaskQueued(task("c2", "interactive")))
    assert preempt(state, NOW) == Preempt("b1", "r")


def test_nothing_is_preempted_while_stopping() -> None:
    state = world({"b": ("batch", False)}, {"c": "interactive"}, stopping=True)
    assert preempt(state, NOW) is None


@pytest.mark.parametrize(("running", "waiting", "pulling", "pulls"), [
    pytest.param({"b": ("batch", False)}, {}, False, True, id="full-with-one-that-may-yield"),
    pytest.param({"b": ("batch", True)}, {}, False, False, id="it-sent-a-token"),
    pytest.param({"i": ("interactive", False)}, {}, False, False, id="nothing-may-yield"),
    pytest.param({"b": ("batch", False)}, {"c": "interactive"}, False, False,
                 id="one-waits-here-already"),
    pytest.param({"b": ("batch", False)}, {}, True, False, id="a-pull-is-out"),
])
def test_pull_to_preempt(running: dict[str, tuple[Priority, bool]], waiting: dict[str, Priority],
                         pulling: bool, pulls: bool) -> None:
    state = world(running, waiting, pulling=frozenset({MODEL}) if pulling else frozenset())
    assert pull_to_preempt(state, MODEL) is pulls


def test_the_planner_pulls_one_interactive_task_for_a_full_runner() -> None:
    assert plan(world({"b": ("batch", False)}, {}), NOW) == Pull(MODEL, 1, only="interactive")


@pytest.mark.parametrize(("running", "waiting", "changes"), [
    pytest.param({"b": ("batch", False)}, {}, {}, id="may-yield"),
    pytest.param({"b": ("batch", True)}, {}, {}, id="sent-a-token"),
    pytest.param({"b": ("batch", False)}, {"c": "interactive"}, {}, id="one-waits"),
    pytest.param({"b": ("batch", False)}, {"w": "batch"}, {}, id="a-batch-task-waits"),
    pytest.param({"b": ("batch", False)}, {}, {"receiving": {"k": MODEL}}, id="one-taken-in"),
    pytest.param({"b": ("batch", False)}, {}, {"pulling": frozenset({MODEL}),
                                               "probing": frozenset({MODEL})}, id="probing"),
    pytest.param({"b1": ("batch", False), "b22": ("default", False)}, {"w": "batch"},
                 {"drained": frozenset({MODEL})}, id="two-slots-drained"),
])
def test_a_full_node_pulls_only_to_preempt(
        running: dict[str, tuple[Priority, bool]], waiting: dict[str, Priority],
        changes: dict[str, object]) -> None:
    """No free slot here: pull's answer is pull_to_preempt's, without the counts of waiting
    tasks (they can only lower a free count that is none already)."""
    state = world(running, waiting, slots=len(running), **changes)
    wanted = Pull(MODEL, 1, only="interactive") if pull_to_preempt(state, MODEL) else None
    assert plan_pull(state, NOW) == wanted


def test_a_slot_that_frees_while_the_probe_waits_ends_the_probe() -> None:
    """The probe holds the model's pull: a freed slot would get none until it came back
    (2 s, then 0.2 s). Ending it once lets the next plan pull for the slot."""
    probing = world({"b": ("batch", False)}, {}, pulling=frozenset({MODEL}))
    probing = apply(probing, ev.PullStarted(MODEL, probe=True))
    assert plan(probing, NOW) is None  # still full: the probe goes on
    freed = apply(probing, ev.TaskEnded("b"))
    assert plan(freed, NOW) == EndProbe(MODEL)
    ending = apply(freed, ev.ProbeEnding(MODEL))
    assert plan(ending, NOW) is None  # told once; the pull ends next
    ended = apply(ending, ev.PullEnded(MODEL))
    assert ended.probing == frozenset() and ended.pulling == frozenset()
    assert isinstance(plan(ended, NOW), Pull)


def test_a_regular_pull_is_never_ended_early() -> None:
    pulling = apply(world({"b": ("batch", False)}, {}), ev.PullStarted(MODEL))
    freed = apply(pulling, ev.TaskEnded("b"))
    assert plan(freed, NOW) is None


def test_a_preempted_task_queued_again_waits_behind_the_interactive_one() -> None:
    """It is older, but dispatch takes the higher class first (fleet.worker.routes)."""
    state = world({}, {"b": "batch", "c": "interactive"})
    assert plan(state, NOW) == Dispatch("c", "r")


@dataclass
class PreemptDesk(Desk):
    def requeue(self, task_id: str) -> None:
        self.left.append(("requeue", task_id))


@pytest.mark.parametrize(("first_token_came", "status", "left"), [
    pytest.param(False, "cancelled", ("requeue", "b"), id="stopped-unseen-queued-again"),
    pytest.param(True, "cancelled", ("hand_back", Stage.STOPPED_MID_RUN),
                 id="a-token-raced-the-cancel-continued-by-its-redelivery"),
    pytest.param(False, "completed", "finish", id="it-ended-before-the-cancel-it-ends"),
])
async def test_a_preempted_tasks_terminal(first_token_came: bool, status: str,
                                          left: object) -> None:
    """What the runner's terminal of a task told to yield becomes (fleet.worker.reports)."""
    desk = PreemptDesk(world({"b": ("batch", first_token_came)}, {"c": "interactive"}))
    desk.apply(ev.CancelNoted("b", ev.CancelOrigin.PREEMPTED))
    async with Supervisor("test") as owner:
        reports = RunnerReports(
            desk, images=ImageOutputs(cast(Any, Store()), TaskSpans(), cast(Any, None),
                                      Inbox(), owner),
            output=cast(Any, Output()), intake=cast(Any, Intake()),
            cluster=cast(Any, Cluster()), runners=cast(Any, Runners()), spans=TaskSpans(),
            inbox=Inbox(), owner=owner,
        )
        end = TaskFinished(task_id="b", at=1.0, status=status)  # type: ignore[arg-type]
        await reports.report(RunnerReported("r", end))
    assert desk.left == [left if left != "finish" else ("finish", end)]


def test_the_fault_engines_slow_prefill_knob(tmp_path: Path) -> None:
    """first_token_ms: the task runs and sends nothing until then (the window to preempt)."""
    clock = FakeClock()
    config = EngineConfig(card=fault_card(), model_path=tmp_path, slots=1, images_dir=tmp_path)
    engine = FaultEngine(config, clock=clock, sleep=clock.sleep)
    engine.admit(Admission(task=TextGeneration(
        task_id="b", model="fault-llm", prompt="tokens:2 first_token_ms:500", max_tokens=9)))
    assert engine.step() == []  # prefilling
    clock.now += 0.5
    assert [e.type for e in engine.step()] == ["token"]
