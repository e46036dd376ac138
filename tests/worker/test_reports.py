"""RunnerReports, composed: an image task whose terminal waits behind an upload when its runner
dies ends once, after its images. The desk is a real WorkerState changed by `apply`; the store
is a stand-in whose upload the test releases (the real store: test_image_flow), and the task's
output is recorded instead of published (plumbing only)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from fleet.aio import Supervisor
from fleet.wire.events import ErrorReason, OutputEvent, TaskFinished
from fleet.wire.tasks import ImageGeneration
from fleet.worker import state as ev
from fleet.worker.acks import Stage, ack_stage
from fleet.worker.continuation import ContinuationBook
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import ImageUploaded, Inbox, RunnerExited, RunnerReported
from fleet.worker.reports import RunnerReports
from fleet.worker.spans import TaskSpans
from fleet.worker.state import PendingTask, RunnerView, WorkerState, apply
from tests.worker.test_image_outputs import Store, image

TASK = ImageGeneration(task_id="t", model="tiny-flux2", prompt="night")


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
