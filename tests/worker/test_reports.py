"""RunnerReports, composed: an image task whose terminal waits behind an upload when its runner
dies ends once, after its images. The desk is a real WorkerState changed by `apply`; the store
is a stand-in whose upload the test releases (the real store: test_image_flow), and the task's
output is recorded instead of published (plumbing only)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from fleet.aio import Supervisor
from fleet.wire.events import ErrorReason, OutputEvent, TaskFinished
from fleet.wire.tasks import ImageGeneration, TextGeneration
from fleet.worker import state as ev
from fleet.worker.acks import Stage, ack_stage
from fleet.worker.continuation import NOT_CONTINUED, ContinuationBook, Continue
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import ImageUploaded, Inbox, RunnerExited, RunnerReported
from fleet.worker.reports import RunnerReports, accept_of
from fleet.worker.spans import TaskSpans
from fleet.worker.state import PendingTask, RunnerView, WorkerState, apply
from tests.worker.test_image_outputs import Store, image

TASK = ImageGeneration(task_id="t", model="tiny-flux2", prompt="night")
TEXT = TextGeneration(task_id="x", model="tiny-llm", prompt="hi")


@dataclass
class Desk:
    """The loop as the reports see it (reports.TaskDesk): its state, and how a task leaves."""

    state: WorkerState
    left: list[tuple[str, Any]] = field(default_factory=list)

    def apply(self, event: ev.StateEvent) -> None:
        self.state = apply(self.state, event)

    def finish(self, report: TaskFinished) -> None:
        self.apply(ev.TaskReleased(report.task_id))
        self.apply(ev.TaskEnded(report.task_id))
        self.left.append(("finish", report))

    def end(self, task_id: str, reason: ErrorReason, message: str) -> None:
        self.left.append(("end", reason))

    def hand_back(self, task_id: str, stage: Stage = Stage.HANDED_BACK) -> None:
        self.left.append(("hand_back", stage))

    def give_up(self, task_id: str) -> None:
        self.left.append(("give_up", task_id))


class Output:
    def __init__(self) -> None:
        self.sent: list[OutputEvent] = []

    async def chunk(self, event: OutputEvent, body: bytes | None = None) -> None:
        self.sent.append(event)


class Cluster:
    def __init__(self) -> None:
        self.records: dict[str, object] = {}
        self.cancelled: dict[str, None] = {}

    def runner_removed(self, runner_id: str) -> None:
        pass


class Runners:
    def exited(self, exited: RunnerExited) -> bool:
        return True


class Intake:
    def __init__(self) -> None:
        self.book = ContinuationBook()


async def test_a_runner_dying_while_its_terminal_waits_behind_an_upload_ends_the_task_once(
) -> None:
    runner = RunnerView("run-1", "inst-1", "tiny-flux2", in_flight=frozenset({"t"}))
    desk = Desk(WorkerState(node_id="n", runners={"run-1": runner}))
    store, inbox, output, intake = Store(), Inbox(), Output(), Intake()
    intake.book.running["t"] = PendingTask(TASK, 0.0, inputs={})  # held: could be continued

    async def send(runner_id: str, command: object) -> bool:
        return True

    async with Supervisor("test") as owner:
        images = ImageOutputs(cast(Any, store), TaskSpans(), send, inbox, owner)
        reports = RunnerReports(
            desk, images=images, output=cast(Any, output), intake=cast(Any, intake),
            cluster=cast(Any, Cluster()), runners=cast(Any, Runners()), spans=TaskSpans(),
            inbox=inbox, owner=owner,
        )
        picture = image("t", 0)
        end = TaskFinished(task_id="t", at=1.0, status="completed")
        assert not reports.admit(RunnerReported("run-1", picture))  # uploading
        assert not reports.admit(RunnerReported("run-1", end))  # behind it
        assert desk.state.task("t").ending  # the state says so, through apply
        assert ack_stage(desk.state, "t") is Stage.RUNNING  # still held, still beaten

        await reports.runner_exited(RunnerExited("run-1", -9, "killed by SIGKILL"))
        assert desk.left == []  # neither crashed nor read back to be restarted
        assert "t" in intake.book.running  # not taken off for a continuation

        store.release(picture.sha256)
        done = await asyncio.wait_for(inbox.get(), 5)
        assert isinstance(done, ImageUploaded) and done.error is None
        for ready in images.uploaded(done):
            await reports.report(ready)
        assert inbox.empty()  # no read-back child, no second terminal on its way
    assert output.sent == [picture]  # the image, announced once it was stored
    assert desk.left == [("finish", end)]  # then its one terminal: the runner's own
    assert "t" not in desk.state.tasks  # released


# ---- the accept the worker publishes at dispatch (issue 23) -------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(("task", "earlier", "seam", "traceparent", "expected"), [
    pytest.param(TEXT, NOT_CONTINUED, None, f"00-{TRACE_ID}-00f067aa0ba902b7-01",
                 {"trace_id": TRACE_ID, "continued_from": 0, "attempt": 0, "seed": None,
                  "moved_from": None}, id="a-first-run"),
    pytest.param(TEXT.model_copy(update={"temperature": 0.7, "seed": 42}),
                 Continue((5, 6), 2, seed=42, moved_from="node-b"),
                 Continue((5, 6), 2, seed=42, moved_from="node-b"), None,
                 {"trace_id": None, "continued_from": 2, "attempt": 2, "seed": 42,
                  "moved_from": "node-b"}, id="a-continuation-says-where-it-resumed"),
    pytest.param(TEXT, NOT_CONTINUED, None, "00-bad", {"trace_id": None},
                 id="a-malformed-traceparent-carries-no-trace"),
])
def test_the_accept_at_dispatch_says_what_the_runner_is_sent(
    task: TextGeneration, earlier: Continue, seam: Continue | None, traceparent: str | None,
    expected: dict[str, Any],
) -> None:
    pending = PendingTask(task=task, received_at=100.0, delivery=3)
    event = accept_of(task, "run-1", "node-a", traceparent, pending, earlier, seam, 100.25)
    assert (event.task_id, event.model, event.node_id, event.runner_id, event.at,
            event.queue_wait_s, event.delivery) == (
        task.task_id, task.model, "node-a", "run-1", 100.25, 0.25, 3)
    assert {key: getattr(event, key) for key in expected} == expected
