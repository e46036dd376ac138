"""The worker's loop handles what its inbox holds, in order, then plans once (issue 23):
a fetched batch's intakes and its tasks' terminals cost one pass of the planner, not one
each. Driven through `Worker._loop` itself with the handling and the planning recorded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleet.wire.events import TaskAccepted, TaskFinished
from fleet.wire.token_frames import TokenFrame
from fleet.worker.inbox import InboxItem, RunnerReported, Stop, Tick
from fleet.worker.main import PLAN_EVERY, Worker, _streams_only

TOKEN = RunnerReported("r1", TokenFrame("t1", 0, b"{}"))
ACCEPTED = RunnerReported("r1", TaskAccepted(task_id="t1", at=0.0, node_id="n1", model="m",
                                              runner_id="r1"))
FINISHED = RunnerReported("r1", TaskFinished(task_id="t1", at=0.0, status="completed"))


@pytest.mark.parametrize(("item", "streams_only"), [
    (TOKEN, True),  # a token event changes nothing the planner reads
    (ACCEPTED, True),
    (FINISHED, False),  # a slot frees
    (Tick(), False),
])
def test_which_items_skip_the_planner(item: InboxItem, streams_only: bool) -> None:
    assert _streams_only(item) is streams_only


class _Reports:
    plan_due = False


def _worker(log: list[Any]) -> Worker:
    worker = Worker.__new__(Worker)
    worker.inbox = asyncio.Queue()
    worker.reports = _Reports()  # type: ignore[assignment]
    worker.handler_failures = 0

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


async def test_a_report_that_asks_for_a_plan_gets_one() -> None:
    log: list[Any] = []
    worker = _worker(log)
    worker.reports.plan_due = True  # e.g. a prefill a waiting task may use (reports.py)
    worker.inbox.put_nowait(TOKEN)
    worker.inbox.put_nowait(Stop())
    await asyncio.wait_for(worker._loop(), 5)
    assert log == [TOKEN, "plan"]
