"""What a runner says, and how the worker answers: statuses into state and the runner
record, events onto the task's stream in order, terminals to the task's ending, and a runner's
exit ending what was still in flight there (from WorkerState, the one record of it).

A part of the worker's loop (fleet.worker.main), composed, not mixed in: what it asks of the
loop is the `TaskDesk` below (the state, `apply`, and the ways a task leaves the node); every
broker call it causes runs in a child (a task's events through the confirmed publisher, the
read-back after a crash, endings), never in the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from fleet.aio import Supervisor
from fleet.telemetry import trace_id_of
from fleet.wire import pipe
from fleet.wire.codec import decode_model
from fleet.wire.events import (
    ErrorChunk,
    ErrorReason,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
)
from fleet.wire.tasks import Task, TextGeneration, sampling_seed
from fleet.wire.token_frames import TokenFrame
from fleet.worker import state as ev
from fleet.worker.acks import Stage
from fleet.worker.cluster import ClusterLink
from fleet.worker.continuation import (
    Continue,
    CrashFate,
    CrashRoute,
    crash_fate,
    crash_route,
    exit_continues_all,
    output_began,
)
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import CrashJudged, Inbox, RunnerExited, RunnerReported
from fleet.worker.intake import Intake
from fleet.worker.outputs import TaskOutput
from fleet.worker.runners import RunnerPool
from fleet.worker.spans import TaskSpans
from fleet.worker.state import PendingTask, WorkerState
from fleet.worker.supervisor import crashed_terminal

log = logging.getLogger(__name__)

# How long a rank whose peer's worker is gone waits for failover's move before it restarts
# into the same ranks all the same: a heartbeat's TTL, after which failover has acted on the
# key's absence even without the death watch (which moves within ~1-3 s).
PEER_GONE_HOLD_S = 15.0


def accept_of(
    task: Task, runner_id: str, node_id: str, traceparent: str | None, pending: PendingTask,
    earlier: Continue, seam: Continue | None, now: float,
) -> TaskAccepted:
    """Pure. The `task_accepted` the worker publishes as it sends `task` (seeded) to
    `runner_id`: its runner's own came a pipe round trip later, on the accept's way (issue
    23). `earlier` is what the dispatch carries of earlier attempts; `seam` where a continued
    task resumed (its previous node, for readers and the trace)."""
    return TaskAccepted(
        task_id=task.task_id, at=now, model=task.model, node_id=node_id, runner_id=runner_id,
        trace_id=trace_id_of(traceparent), queue_wait_s=max(0.0, now - pending.received_at),
        delivery=pending.delivery, continued_from=len(earlier.generated),
        attempt=earlier.attempt, seed=sampling_seed(task),
        moved_from=seam.moved_from if seam is not None else None,
    )


class TaskDesk(Protocol):
    """What the reports ask of the worker's loop."""

    @property
    def state(self) -> WorkerState: ...

    def apply(self, event: ev.StateEvent) -> None: ...

    def finish(self, report: TaskFinished) -> None: ...

    def end(self, task_id: str, reason: ErrorReason, message: str) -> None: ...

    def hand_back(self, task_id: str, stage: Stage = Stage.HANDED_BACK) -> None: ...

    def give_up(self, task_id: str) -> None: ...

    def requeue(self, task_id: str) -> None: ...


class RunnerReports:
    def __init__(
        self, desk: TaskDesk, *, images: ImageOutputs, output: TaskOutput, intake: Intake,
        cluster: ClusterLink, runners: RunnerPool, spans: TaskSpans, inbox: Inbox,
        owner: Supervisor,
    ) -> None:
        self.desk = desk
        self.images = images
        self.output = output
        self.intake = intake
        self.cluster = cluster
        self.runners = runners
        self.spans = spans
        self.inbox = inbox
        self.owner = owner
        self.unsent_chunks = 0  # task events the broker would not take (logged each time)
        self.plan_due = False  # a streamed report changed what the planner reads

    @property
    def state(self) -> WorkerState:
        return self.desk.state

    def _cut_short(self, report: TaskFinished) -> bool:
        """A runner stopped under its tasks (the worker stopping, or its instance moved or
        removed) cancels what it runs: that is not the user's cancel, and must not reach the
        task's stream as one. Only the worker's own cancels are real ones: a user's, or an
        image that could not be stored (its terminal becomes that failure)."""
        return (
            report.status == "cancelled"
            and self.state.task(report.task_id).cancel is not ev.CancelOrigin.WHILE_RUNNING
            and report.task_id not in self.images.unstored
        )

    def _preempted_unseen(self, report: TaskFinished, runner_id: str) -> bool:
        """Preempted and stopped before its first output: it starts again from nothing. One
        whose first token came meanwhile is cut short (`_cut_short`): its redelivery
        continues from what was stored."""
        return (
            report.status == "cancelled"
            and self.state.task(report.task_id).cancel is ev.CancelOrigin.PREEMPTED
            and report.task_id in self._prefilling(runner_id)
        )

    async def report(self, reported: RunnerReported) -> None:
        report, runner_id = reported.report, reported.runner_id
        for frame in reported.tail:  # first, as if they had come alone: the guards read it
            self._first_output(runner_id, frame)
        with self.spans.active(getattr(report, "task_id", None)):
            await self._on_report(runner_id, report, reported.tail)

    async def _on_report(
        self, runner_id: str, report: pipe.RunnerReport | TokenFrame,
        tail: tuple[TokenFrame, ...] = (),
    ) -> None:
        """`tail`: a terminal's token events read with it (fleet.worker.tails). They are
        stored inside the terminal when it is the task's next event to store; on every other
        path they go out first, as events of their own, as when they came alone."""
        match report:
            case pipe.RunnerStatusReport(status=status):
                self.desk.apply(ev.RunnerStatusSeen(runner_id, status))
                self.cluster.runner_status(self.state.runners.get(runner_id), status)
            case TaskFinished() if (
                self.state.task(report.task_id).cancel is ev.CancelOrigin.FENCED
            ):
                await self._alone(tail)
                self.desk.give_up(report.task_id)  # taken over elsewhere: nothing more is ours
            case TaskFinished() if self._preempted_unseen(report, runner_id):
                await self._alone(tail)
                self.desk.requeue(report.task_id)  # fleet.worker.preemption
            case TaskFinished() if self._cut_short(report):
                await self._alone(tail)
                self.desk.hand_back(report.task_id, Stage.STOPPED_MID_RUN)
            case TaskFinished():
                report = self.images.final(report, runner_id)
                if report.status == "failed" and report.reason and report.message:
                    tail = await self._alone(tail)  # before the error event, as they came
                    await self._chunk(ErrorChunk(
                        task_id=report.task_id, at=report.at, reason=report.reason,
                        message=report.message,
                    ))
                if tail:  # stored with the terminal, in one message (TaskOutput.finish)
                    report = report.model_copy(update={"last_tokens": [
                        decode_model(TokenChunk, frame.body) for frame in tail]})
                self.desk.finish(report)  # whatever became of the chunk, the task ends
                # Its runner's Ready may have been recorded while this terminal waited
                # behind an image upload (still counting it): the record follows the end.
                view, record = self.state.runners.get(runner_id), self.cluster.records.get(
                    runner_id)
                if view and record and record.active_tasks != len(view.in_flight):
                    self.cluster.runner_status(view, view.status)
            case _:
                self._first_output(runner_id, report)
                await self._chunk(report)

    def _first_output(self, runner_id: str, report: OutputEvent | TokenFrame) -> None:
        if report.type != "task_accepted" and report.task_id in self._prefilling(runner_id):
            self.desk.apply(ev.FirstOutput(report.task_id, runner_id))  # once a task
            self.plan_due = True  # a task may wait for this prefill

    async def _alone(self, tail: tuple[TokenFrame, ...]) -> tuple[TokenFrame, ...]:
        """Send a terminal's tail as events of their own (it will not be stored inside the
        terminal); returns the empty tail left."""
        for frame in tail:
            await self._chunk(frame)
        return ()

    async def accepted(self, event: TaskAccepted) -> None:
        """Publish a task's accept (`accept_of`) before its runner can say anything of it."""
        await self._chunk(event)

    def _prefilling(self, runner_id: str) -> Mapping[str, int]:
        runner = self.state.runners.get(runner_id)
        return runner.prefill if runner is not None else {}

    async def _chunk(self, event: OutputEvent | TokenFrame) -> None:
        """A task's event, in order behind its earlier ones (a TokenFrame: published as its
        runner wrote it). One that cannot be sent is logged and counted; the terminal still
        comes, and TaskOutput.finish does not let a task with a hole in its output end
        completed."""
        try:
            await self.output.chunk(event)
        except Exception as exc:
            self.unsent_chunks += 1
            log.warning("task %s: %s event not sent (%s: %s)", event.task_id, event.type,
                        type(exc).__name__, exc)

    async def runner_exited(self, exited: RunnerExited) -> None:
        """The runner is gone: every task still in flight there (WorkerState says which) ends
        runner_crashed, behind any image of it still uploading; one that may be continued
        (its message still held) leaves the dead runner at once and waits for a child's
        read-back of what it streamed (`_judge_crash`, then `crash_judged`)."""
        runner_id = exited.runner_id
        view = self.state.runners.get(runner_id)
        crashed = self.runners.exited(exited)
        for task_id in sorted(view.in_flight if view else ()):
            fate = crash_fate(terminal_waiting=self.state.task(task_id).ending,
                              held_for_continuation=task_id in self.intake.book.running)
            if fate is CrashFate.ENDING:
                continue  # its terminal follows its images (ImageOutputs), then its ack
            if fate is CrashFate.CRASHED:
                await self._crashed(task_id, exited)
                continue
            pending = self.intake.book.running.pop(task_id)
            self.desk.apply(ev.TaskEnded(task_id))  # off the dead runner; its message stays held
            self.owner.spawn(f"read back {task_id}", self._judge_crash(task_id, exited, pending))
        self.desk.apply(ev.RunnerGone(runner_id, crashed=crashed, at=time.time()))
        self.cluster.runner_removed(runner_id)
        if crashed and view is not None and view.layout:
            # The other ranks wait on a ring this rank left: restart the whole group.
            self.runners.owner.spawn(
                f"restart group {view.instance_id}",
                self.cluster.restart_group(view.instance_id, view.layout),
            )
            self.runners.owner.spawn(f"probe the peers of {view.instance_id}",
                                     self._hold_for_gone_peers(view.instance_id, view.layout))

    async def _hold_for_gone_peers(self, instance_id: str, layout: tuple[object, ...]) -> None:
        """A child: when a peer rank's worker is gone, this rank's restart into the same
        ranks waits for failover to move the peer's shard (ev.Failure.held_until). A runner
        restarted into the old ranks listens on this node's ring address until the move
        stops it, and the moved rank's new runner, connecting there, could join it and not
        its successor: then neither new runner's ring forms until its 120 s timeout."""
        if gone := await self.cluster.gone_peers(layout):
            log.warning("%s: the worker of peer rank node(s) %s is gone: its restart waits for "
                        "their move (at most %.0f s)", instance_id, ", ".join(gone),
                        PEER_GONE_HOLD_S)
            self.inbox.put_nowait(ev.GroupPeerGone(
                instance_id, ev.ranks_of(layout), time.time() + PEER_GONE_HOLD_S))

    async def _judge_crash(
        self, task_id: str, exited: RunnerExited, pending: PendingTask
    ) -> None:
        """A child: whether a task cut short by its runner's exit goes on (its output began,
        or its group's ring broke, and fleet.worker.continuation says how); the answer goes
        back to the loop (`exit_continues_all`)."""
        decided: Continue | None = None
        try:
            if (exit_continues_all(exited.returncode)
                    or output_began(await self.output.last_event(task_id))):
                found = await self.intake.continuation(pending.task)
                decided = found if isinstance(found, Continue) else None
        except Exception as exc:  # its output cannot be read: it ends runner_crashed
            log.warning("task %s: what it streamed could not be read back (%s: %s)",
                        task_id, type(exc).__name__, exc)
        self.inbox.put_nowait(CrashJudged(task_id, exited, pending, decided))

    async def crash_judged(self, judged: CrashJudged) -> None:
        """A text task continues from its next token, an image task restarts from step 0
        with the same seed, on the restarted runner or another; else it ends runner_crashed
        as before (no output yet, or its continuations used up)."""
        task_id, decided = judged.task_id, judged.decided
        if decided is None or self.state.stopping or task_id in self.cluster.cancelled:
            self.intake.book.queued.pop(task_id, None)
            if self.state.stopping:
                self.desk.hand_back(task_id, Stage.STOPPED_MID_RUN)
            elif task_id in self.cluster.cancelled:
                self.desk.end(task_id, ErrorReason.CANCELLED, "cancelled")
            else:
                await self._crashed(task_id, judged.exited)
            return
        task = judged.pending.task
        ready_here = any(r.model == task.model and r.takes_tasks and not r.shutting_down
                         for r in self.state.runners.values())
        route = crash_route(text=isinstance(task, TextGeneration), runner_ready_here=ready_here)
        if route is CrashRoute.HAND_BACK:
            self.desk.hand_back(task_id, Stage.STOPPED_MID_RUN)
            self.output.forget(task_id)  # whoever takes it over fences it
            return
        if uploading := self.images.on_the_way(task_id):
            # Not stored yet but already made: the restart must not announce them again.
            self.intake.book.queued[task_id] = replace(
                decided, delivered_images=decided.delivered_images | uploading
            )
        self.desk.apply(ev.TaskQueued(judged.pending))  # waiting for a slot again

    async def _crashed(self, task_id: str, exited: RunnerExited) -> None:
        lost = crashed_terminal(task_id, exited, self.state.node_id)
        item = RunnerReported(exited.runner_id, lost)
        if self.admit(item):
            await self.report(item)

    def admit(self, item: RunnerReported) -> bool:
        """Whether the loop handles `item` now (ImageOutputs.admit); a terminal that waits
        behind an upload instead makes its task `ending` in WorkerState."""
        if self.images.admit(item):
            return True
        if isinstance(item.report, TaskFinished) and self.images.ending(item.report.task_id):
            log.info("task %s: its terminal waits behind an image upload", item.report.task_id)
            self.desk.apply(ev.TerminalQueued(item.report.task_id))
        return False
