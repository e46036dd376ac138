"""What a runner says, and how the worker answers: statuses into state and the runner
record, events onto the task's stream in order, terminals to the task's ending, and a runner's
exit ending what was still in flight there (from WorkerState, the one record of it).

A mixin of `Worker` (fleet.worker.main), kept apart so each file stays readable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from fleet import telemetry
from fleet.wire import pipe
from fleet.wire.events import ErrorChunk, ErrorReason, OutputEvent, TaskAccepted, TaskFinished
from fleet.wire.tasks import TextGeneration
from fleet.worker import state as ev
from fleet.worker.acks import Stage
from fleet.worker.continuation import (
    Continue,
    CrashFate,
    CrashRoute,
    crash_fate,
    crash_route,
    output_began,
)
from fleet.worker.inbox import CrashJudged, RunnerExited, RunnerReported
from fleet.worker.state import PendingTask
from fleet.worker.supervisor import crashed_terminal

if TYPE_CHECKING:
    from fleet.worker.main import Worker

log = logging.getLogger(__name__)


class RunnerReports:
    def _cut_short(self: Worker, report: TaskFinished) -> bool:
        """A runner stopped under its tasks (the worker stopping, or its instance moved or
        removed) cancels what it runs: that is not the user's cancel, and must not reach the
        task's stream as one. Only the worker's own cancels are real ones: a user's, or an
        image that could not be stored (its terminal becomes that failure)."""
        return (
            report.status == "cancelled"
            and self.state.notes_of(report.task_id).cancel is not ev.CancelOrigin.WHILE_RUNNING
            and report.task_id not in self.images.unstored
        )

    async def _report(self: Worker, reported: RunnerReported) -> None:
        report = reported.report
        with self.spans.active(getattr(report, "task_id", None)):
            await self._on_report(reported.runner_id, report)

    async def _on_report(self: Worker, runner_id: str, report: pipe.RunnerReport) -> None:
        match report:
            case pipe.RunnerStatusReport(status=status):
                self._apply(ev.RunnerStatusSeen(runner_id, status))
                self.cluster.runner_status(self.state.runners.get(runner_id), status)
            case TaskFinished() if (
                self.state.notes_of(report.task_id).cancel is ev.CancelOrigin.FENCED
            ):
                self._give_up(report.task_id)  # taken over elsewhere: nothing more is ours
            case TaskFinished() if self._cut_short(report):
                self._hand_back(report.task_id, Stage.STOPPED_MID_RUN)
            case TaskFinished():
                report = self.images.final(report, runner_id)
                if report.status == "failed" and report.reason and report.message:
                    await self._chunk(ErrorChunk(
                        task_id=report.task_id, at=report.at, reason=report.reason,
                        message=report.message,
                    ))
                self._finish(report)  # whatever became of the chunk, the task ends
                # Its runner's Ready may have been recorded while this terminal waited
                # behind an image upload (still counting it): the record follows the end.
                view, record = self.state.runners.get(runner_id), self.cluster.records.get(
                    runner_id)
                if view and record and record.active_tasks != len(view.in_flight):
                    self.cluster.runner_status(view, view.status)
            case pipe.SpanBatch(spans=records):
                telemetry.export_records(records)
            case pipe.TaskRunning():
                pass
            case TaskAccepted() if (seam := self.intake.book.seams.get(report.task_id)):
                # The seam, for readers and the trace: where this attempt moved from.
                await self._chunk(report.model_copy(update={"moved_from": seam.moved_from}))
            case _:
                if report.type != "task_accepted" and report.task_id in self._prefilling(runner_id):
                    self._apply(ev.FirstOutput(report.task_id, runner_id))  # once a task
                    self.plan_due = True  # a task may wait for this prefill
                await self._chunk(report)

    def _prefilling(self: Worker, runner_id: str) -> Mapping[str, int]:
        runner = self.state.runners.get(runner_id)
        return runner.prefill if runner is not None else {}

    async def _chunk(self: Worker, event: OutputEvent) -> None:
        """A task's event, in order behind its earlier ones. One that cannot be sent is
        logged and counted; the terminal still comes, and TaskOutput.finish does not let a
        task with a hole in its output end completed."""
        try:
            await self.output.chunk(event)
        except Exception as exc:
            self.unsent_chunks += 1
            log.warning("task %s: %s event not sent (%s: %s)", event.task_id, event.type,
                        type(exc).__name__, exc)

    async def _runner_exited(self: Worker, exited: RunnerExited) -> None:
        """The runner is gone: every task still in flight there (WorkerState says which) ends
        runner_crashed, behind any image of it still uploading; one that may be continued
        (its message still held) leaves the dead runner at once and waits for a child's
        read-back of what it streamed (`_judge_crash`, then `_crash_judged`)."""
        runner_id = exited.runner_id
        view = self.state.runners.get(runner_id)
        crashed = self.runners.exited(exited)
        for task_id in sorted(view.in_flight if view else ()):
            fate = crash_fate(terminal_waiting=self.images.ending(task_id),
                              held_for_continuation=task_id in self.intake.book.running)
            if fate is CrashFate.ENDING:
                continue  # its terminal follows its images (ImageOutputs), then its ack
            if fate is CrashFate.CRASHED:
                await self._crashed(task_id, exited)
                continue
            pending = self.intake.book.running.pop(task_id)
            self._apply(ev.TaskEnded(task_id))  # off the dead runner; its message stays held
            self.owner.spawn(f"read back {task_id}", self._judge_crash(task_id, exited, pending))
        self._apply(ev.RunnerGone(runner_id, crashed=crashed, at=time.time()))
        self.cluster.runner_removed(runner_id)
        if crashed and view is not None and view.layout:
            # The other ranks wait on a ring this rank left: restart the whole group.
            self.runners.owner.spawn(
                f"restart group {view.instance_id}",
                self.cluster.restart_group(view.instance_id, view.layout),
            )

    async def _judge_crash(
        self: Worker, task_id: str, exited: RunnerExited, pending: PendingTask
    ) -> None:
        """A child: whether a task cut short by its runner's exit goes on (its output began
        and fleet.worker.continuation says how); the answer goes back to the loop."""
        decided: Continue | None = None
        try:
            if output_began(await self.output.last_event(task_id)):
                found = await self.intake.continuation(pending.task)
                decided = found if isinstance(found, Continue) else None
        except Exception as exc:  # its output cannot be read: it ends runner_crashed
            log.warning("task %s: what it streamed could not be read back (%s: %s)",
                        task_id, type(exc).__name__, exc)
        self.inbox.put_nowait(CrashJudged(task_id, exited, pending, decided))

    async def _crash_judged(self: Worker, judged: CrashJudged) -> None:
        """A text task continues from its next token, an image task restarts from step 0
        with the same seed, on the restarted runner or another; else it ends runner_crashed
        as before (no output yet, or its continuations used up)."""
        task_id, decided = judged.task_id, judged.decided
        if decided is None or self.state.stopping or task_id in self.cluster.cancelled:
            self.intake.book.queued.pop(task_id, None)
            if self.state.stopping:
                self._hand_back(task_id, Stage.STOPPED_MID_RUN)
            elif task_id in self.cluster.cancelled:
                self._end(task_id, ErrorReason.CANCELLED, "cancelled")
            else:
                await self._crashed(task_id, judged.exited)
            return
        task = judged.pending.task
        ready_here = any(r.model == task.model and r.takes_tasks and not r.shutting_down
                         for r in self.state.runners.values())
        route = crash_route(text=isinstance(task, TextGeneration), runner_ready_here=ready_here)
        if route is CrashRoute.HAND_BACK:
            self._hand_back(task_id, Stage.STOPPED_MID_RUN)
            self.output.forget(task_id)  # whoever takes it over fences it
            return
        if uploading := self.images.on_the_way(task_id):
            # Not stored yet but already made: the restart must not announce them again.
            self.intake.book.queued[task_id] = replace(
                decided, delivered_images=decided.delivered_images | uploading
            )
        self._apply(ev.TaskQueued(judged.pending))  # waiting for a slot again

    async def _crashed(self: Worker, task_id: str, exited: RunnerExited) -> None:
        lost = crashed_terminal(task_id, exited, self.state.node_id)
        item = RunnerReported(exited.runner_id, lost)
        if self.images.admit(item):
            await self._report(item)
