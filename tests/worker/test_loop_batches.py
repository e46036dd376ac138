"""The worker's loop handles what its inbox holds, in order, then plans once (issue 23):
a fetched batch's intakes and its tasks' terminals cost one pass of the planner, not one
each. Driven through `Worker._loop` itself with the handling and the planning recorded."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fleet.wire import pipe
from fleet.wire.cluster import Instance, ShardAssignment
from fleet.wire.events import TaskAccepted, TaskFinished
from fleet.wire.runners import (
    RunnerFailed,
    RunnerLoaded,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
)
from fleet.wire.tasks import TextGeneration
from fleet.wire.token_frames import TokenFrame
from fleet.worker import state as ev
from fleet.worker.inbox import InboxItem, RunnerReported, Stop, Tick
from fleet.worker.main import PLAN_EVERY, Worker, plans_nothing
from fleet.worker.plan import Pull
from fleet.worker.state import PendingTask, RunnerView, WorkerState, apply

TOKEN = RunnerReported("r1", TokenFrame("t1", 0, b"{}"))
ACCEPTED = RunnerReported("r1", TaskAccepted(task_id="t1", at=0.0, node_id="n1", model="m",
                                              runner_id="r1"))
FINISHED = RunnerReported("r1", TaskFinished(task_id="t1", at=0.0, status="completed"))


def _status(status: RunnerStatus) -> RunnerReported:
    return RunnerReported("r1", pipe.RunnerStatusReport(status=status))


def _with_r1(status: RunnerStatus) -> WorkerState:
    runner = RunnerView("r1", "i1", "m", status=status, slots=4)
    return WorkerState(node_id="n1", runners={"r1": runner})


READY_R1 = _with_r1(RunnerReady())


@pytest.mark.parametrize(("item", "state", "skips"), [
    (TOKEN, READY_R1, True),  # a token event changes nothing the planner reads
    (ACCEPTED, READY_R1, True),
    (FINISHED, READY_R1, False),  # a slot frees
    (Tick(), READY_R1, False),
    # between the states that take tasks: nothing the rules read changes
    (_status(RunnerRunning(active_tasks=1)), READY_R1, True),
    (_status(RunnerReady()), _with_r1(RunnerRunning(active_tasks=1)), True),
    (_status(RunnerRunning(active_tasks=2)), _with_r1(RunnerRunning(active_tasks=1)), True),
    # a runner that starts or stops taking tasks, or is at a lifecycle step: planned for
    (_status(RunnerReady()), _with_r1(RunnerLoaded()), False),
    (_status(RunnerFailed(error="boom")), READY_R1, False),
    (_status(RunnerLoaded()), READY_R1, False),
    (_status(RunnerReady()), WorkerState(node_id="n1"), False),  # not a runner it knows
])
def test_which_items_skip_the_planner(item: InboxItem, state: WorkerState, skips: bool) -> None:
    assert plans_nothing(item, state) is skips


class _Reports:
    plan_due = False


def _worker(log: list[Any]) -> Worker:
    worker = Worker.__new__(Worker)
    worker.inbox = asyncio.Queue()
    worker.reports = _Reports()  # type: ignore[assignment]
    worker.handler_failures = 0
    worker.state = READY_R1

    async def handle(item: InboxItem) -> None:
        log.append(item)
        if item == "boom":
            raise RuntimeError("one item's trouble")

    async def drive() -> None:
        log.append("plan")

    worker.handle = handle  # type: ignore[method-assign]
    worker._drive = drive  # type: ignore[method-assign]
    return worker


@pytest.mark.parametrize(("queued", "expected"), [
    # alone in the inbox: planned after at once, as before
    ([Tick()], [Tick(), "plan"]),
    # what waits together is handled in order, then planned once
    ([Tick(), FINISHED, Tick()], [Tick(), FINISHED, Tick(), "plan"]),
    # a batch of token events alone needs no plan
    ([TOKEN, TOKEN], [TOKEN, TOKEN]),
    ([TOKEN, FINISHED, TOKEN], [TOKEN, FINISHED, TOKEN, "plan"]),
    # a failed item is logged and counted; the others go on and are planned after
    (["boom", Tick()], ["boom", Tick(), "plan"]),
    # no more than PLAN_EVERY items between two plans
    ([Tick()] * (PLAN_EVERY + 1), [Tick()] * PLAN_EVERY + ["plan", Tick(), "plan"]),
])
async def test_the_loop_plans_once_for_what_waits_together(
    queued: list[Any], expected: list[Any]
) -> None:
    log: list[Any] = []
    worker = _worker(log)
    for item in [*queued, Stop()]:
        worker.inbox.put_nowait(item)
    await asyncio.wait_for(worker._loop(), 5)
    assert log == expected
    assert worker.handler_failures == queued.count("boom")


async def test_items_before_a_stop_are_planned_for_and_the_rest_left() -> None:
    log: list[Any] = []
    worker = _worker(log)
    for item in (FINISHED, Stop(), Tick()):
        worker.inbox.put_nowait(item)
    await asyncio.wait_for(worker._loop(), 5)
    assert log == [FINISHED, "plan"]
    assert worker.inbox.qsize() == 1


@pytest.mark.parametrize(("waiting", "expected"), [
    (True, [TOKEN, "plan"]),
    (False, [TOKEN]),  # what a prefill's end changes is read for waiting tasks only
])
async def test_a_report_that_asks_for_a_plan_gets_one_while_a_task_waits(
    waiting: bool, expected: list[Any]
) -> None:
    log: list[Any] = []
    worker = _worker(log)
    if waiting:
        task = TextGeneration(task_id="t2", model="m", prompt="hi")
        worker.state = apply(READY_R1, ev.TaskQueued(PendingTask(task, 0.0, inputs={})))
    worker.reports.plan_due = True  # e.g. a prefill a waiting task may use (reports.py)
    worker.inbox.put_nowait(TOKEN)
    worker.inbox.put_nowait(Stop())
    await asyncio.wait_for(worker._loop(), 5)
    assert log == expected
    if not waiting:
        assert worker.reports.plan_due is False  # spent (the real _drive spends it too)


class _Runners:
    def tend_standby(self, state: WorkerState) -> None:
        pass


async def test_a_held_pulls_wake_is_set_and_dropped_once_its_intakes_answer() -> None:
    """A drained model's pull waits for its young intakes (plan.pull_held_until): the loop
    sets a wake for the hold's end, and drops it when the intakes answer first (the plan it
    makes then pulls), instead of planning once more for nothing."""
    worker = Worker.__new__(Worker)
    worker.inbox = asyncio.Queue()
    worker.reports = _Reports()  # type: ignore[assignment]
    worker.runners = _Runners()  # type: ignore[assignment]
    worker._held_wake = None
    acted: list[object] = []

    async def act(action: object) -> None:
        assert isinstance(action, Pull), action  # the only action this state allows
        acted.append(action)
        worker.apply(ev.PullStarted(action.model))

    worker._act = act  # type: ignore[method-assign]
    now = time.time()
    hosted = Instance(instance_id="i1", model="m", created_at=0.0,
                      shards=[ShardAssignment(node_id="n1", runner_id="r1")])
    state = apply(_with_r1(RunnerReady()), ev.InstancesChanged({"i1": hosted}))
    state = apply(state, ev.PullEnded("m", drained=True))
    worker.state = apply(state, ev.IntakeStarted("intake-1", "m", now + 60.0))  # young
    await worker._drive()
    assert acted == [] and worker._held_wake is not None
    wake = worker._held_wake
    worker.apply(ev.IntakeEnded("intake-1"))
    await worker._drive()
    assert [type(action) for action in acted] == [Pull]
    assert worker._held_wake is None and wake.cancelled()
    assert worker.inbox.empty()
