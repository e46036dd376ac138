"""The worker: the node's one effectful loop. Receive, apply, plan, act, publish."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from fleet import telemetry
from fleet.aio import TaskSet
from fleet.bus.connect import connect
from fleet.bus.provision import provision
from fleet.config import Settings
from fleet.runner import protocol as pipe
from fleet.wire import subjects
from fleet.wire.events import (
    ErrorChunk,
    ErrorReason,
    ImageChunk,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.tasks import CancelTask
from fleet.worker import plan as rules
from fleet.worker import state as ev
from fleet.worker.cluster import ClusterLink
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import CancelSeen, Fetched, InputsFailed, InputsFetched, Stop, Tick
from fleet.worker.intake import Intake, Queued
from fleet.worker.outputs import TaskOutput
from fleet.worker.pulls import TaskPuller
from fleet.worker.runners import RunnerPool
from fleet.worker.spans import TaskSpans
from fleet.worker.state import WorkerState, apply
from fleet.worker.supervisor import RunnerExited

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, settings: Settings, ready: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.ready = ready or asyncio.Event()
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.msgs: dict[str, Msg] = {}  # task id -> its JetStream message, until acked
        self.background = TaskSet()
        self.pinned: dict[str, list[str]] = {}  # task id -> input images it holds in cache
        self.spans = TaskSpans()

    async def run(self) -> None:
        settings = self.settings
        self.nc = await connect(settings.url, "fleet-worker")
        self.js = self.nc.jetstream()
        telemetry.export_to_nats(lambda: self.nc)
        await provision(self.nc)
        self.output = TaskOutput(self.nc, self.js)
        self.cluster = ClusterLink(settings, self.nc, self.js, self.inbox)
        await self.cluster.start()
        self.state = WorkerState(node_id=self.cluster.node_id, cards=self.cluster.cards)
        self.intake = Intake(self.js, self.output, self.cluster)
        self.runners = RunnerPool(settings, self.cluster.node_id, self.inbox)
        self.images = ImageOutputs(self.cluster, self.output, self.spans, self.runners.send)
        self.puller = TaskPuller(self.nc, self.js, settings)
        await self.nc.subscribe(subjects.cancel("*"), cb=self._on_cancel)
        self.background.spawn(self._tick_forever())
        log.info("worker %s serving on %s", self.cluster.node_id, settings.url)
        self.ready.set()
        try:
            while not isinstance(item := await self.inbox.get(), Stop):
                await self._handle(item)
                if not _streams_only(item):
                    await self._drive()
        finally:
            await self._shutdown()

    def stop(self) -> None:
        """Ask the loop to end and shut down cleanly. A message, not a cancel: nats-py
        swallows CancelledError inside publish, so a cancel can be lost mid-await."""
        self.inbox.put_nowait(Stop())

    # ---- the loop ---------------------------------------------------------------------

    def _apply(self, event: object) -> None:
        self.state = apply(self.state, event)

    async def _drive(self) -> None:
        while (action := rules.plan(self.state, time.time())) is not None:
            await self._act(action)

    async def _handle(self, item: Any) -> None:
        match item:
            case Fetched(model=model, msgs=msgs):
                self._apply(ev.PullEnded(model))
                for msg in msgs:
                    await self._take(msg)
            case (runner_id, RunnerExited() as exited):
                crashed = self.runners.exited(exited)
                self._apply(ev.RunnerGone(runner_id, crashed=crashed, at=time.time()))
                self.cluster.runner_removed(runner_id)
            case (runner_id, report):
                with self.spans.active(getattr(report, "task_id", None)):
                    await self._on_report(runner_id, report)
            case InputsFetched(task_id=task_id, paths=paths):
                self._inputs_fetched(task_id, paths)
            case InputsFailed(task_id=task_id, reason=reason, message=message):
                if task_id in self.state.pending:  # else it already ended (cancel, deadline)
                    await self._end(task_id, reason, message)
            case CancelSeen(task_id=task_id):
                await self._cancel(task_id)
            case Tick():
                await self._heartbeat_tasks()
            case _:
                self._apply(item)

    async def _take(self, msg: Msg) -> None:
        span = self.spans.received(msg)
        with self.spans.current(span):
            outcome = await self.intake.receive(msg)
        if isinstance(outcome, Queued):
            self.msgs[outcome.pending.task.task_id] = msg
            self.spans.queued(outcome.pending.task.task_id, outcome.pending.task.model, span)
            self._apply(ev.TaskQueued(outcome.pending))
        else:
            self.spans.settled(outcome.task_id, outcome.verb, span, outcome.reason)

    async def _act(self, action: rules.Action) -> None:
        match action:
            case rules.StopRunner(runner_id=runner_id):
                self._apply(ev.CommandSent(runner_id, "shutdown"))
                self.runners.stop(runner_id)
            case rules.SpawnRunner(instance=instance):
                self._apply(ev.RunnerStarting(instance.instance_id))
                self.runners.spawn(instance, self.state.cards.get(instance.model))
            case rules.AdvanceRunner(runner_id=runner_id, command=command):
                self._apply(ev.CommandSent(runner_id, command))
                await self.runners.send(runner_id, _LIFECYCLE[command]())
            case rules.FinishPending(task_id=task_id, reason=reason, message=message):
                await self._end(task_id, reason, message)
            case rules.FetchInputs(task_id=task_id, hashes=hashes):
                self._apply(ev.InputsFetching(task_id))
                self.background.spawn(self._fetch_inputs(task_id, hashes))
            case rules.Dispatch(task_id=task_id, runner_id=runner_id):
                await self._dispatch(task_id, runner_id)
            case rules.Pull(model=model, batch=batch):
                self._apply(ev.PullStarted(model))
                self.background.spawn(self._pull(model, batch))

    # ---- actions ----------------------------------------------------------------------

    async def _pull(self, model: str, batch: int) -> None:
        await self.inbox.put(Fetched(model, await self.puller.fetch(model, batch)))

    async def _fetch_inputs(self, task_id: str, hashes: tuple[str, ...]) -> None:
        try:
            with self.spans.child(task_id, "fetch inputs", {"fleet.images": len(hashes)}):
                paths = await self.cluster.fetch_inputs(hashes)
        except Exception as exc:
            reason = getattr(exc, "reason", ErrorReason.INTERNAL)
            await self.inbox.put(InputsFailed(task_id, ErrorReason(reason), str(exc)))
            return
        await self.inbox.put(InputsFetched(task_id, paths))

    def _inputs_fetched(self, task_id: str, paths: dict[str, Path]) -> None:
        if task_id not in self.state.pending:  # it ended while they were fetched: unpin
            self.cluster.release_inputs(list(paths))
            return
        self.pinned[task_id] = list(paths)
        self._apply(ev.InputsReady(task_id, {sha: str(path) for sha, path in paths.items()}))

    async def _dispatch(self, task_id: str, runner_id: str) -> None:
        pending = self.state.pending[task_id]
        traceparent, tracestate = self.spans.dispatched(task_id, runner_id)
        self._apply(ev.TaskDispatched(task_id, runner_id))
        await self.runners.send(runner_id, pipe.SubmitTask(
            task=pending.task, inputs=pending.inputs or {}, delivery=pending.delivery,
            queue_wait_s=max(0.0, time.time() - pending.received_at),
            traceparent=traceparent, tracestate=tracestate,
        ))

    async def _end(self, task_id: str, reason: ErrorReason, message: str) -> None:
        with self.spans.active(task_id):
            finished = await self.output.fail(task_id, reason, message, node_id=self.state.node_id)
        self.spans.finished(finished)
        await self._settle(task_id)

    async def _settle(self, task_id: str) -> None:
        """Ack only after the terminal event is in FLEET_OUT: then nothing can be lost."""
        if pinned := self.pinned.pop(task_id, None):
            self.cluster.release_inputs(pinned)
        if msg := self.msgs.pop(task_id, None):
            with contextlib.suppress(Exception):
                await msg.ack()
        self.spans.settled(task_id, "ack")
        self._apply(ev.TaskEnded(task_id))

    async def _on_report(self, runner_id: str, report: Any) -> None:
        match report:
            case pipe.RunnerStatusReport(status=status):
                self._apply(ev.RunnerStatusSeen(runner_id, status))
                self.cluster.runner_status(self.state.runners.get(runner_id), status)
            case TaskFinished():
                report = self.images.final(report, runner_id)
                if report.status == "failed" and report.reason and report.message:
                    await self.output.chunk(ErrorChunk(
                        task_id=report.task_id, at=report.at, reason=report.reason,
                        message=report.message,
                    ))
                await self.output.finish(report)
                self.spans.finished(report)
                await self._settle(report.task_id)
            case pipe.SpanBatch(spans=records):
                telemetry.export_records(records)
            case pipe.TaskRunning():
                pass
            case ImageChunk():
                await self.images.announce(runner_id, report)
            case _:
                await self.output.chunk(report)

    async def _cancel(self, task_id: str) -> None:
        if task_id in self.state.pending:
            await self._end(task_id, ErrorReason.CANCELLED, "cancelled before it started")
            return
        for runner in self.state.runners.values():
            if task_id in runner.in_flight:
                await self.runners.send(runner.runner_id, CancelTask(task_id=task_id))
                return
        # Not taken in yet (a fetch still on its way here, or not fetched at all): remembered,
        # so the intake ends the task cancelled as soon as it arrives.
        self.cluster.remember_cancel(task_id)

    async def _on_cancel(self, msg: Msg) -> None:
        task_id = msg.subject.rsplit(".", 1)[-1]
        await self.inbox.put(CancelSeen(task_id))

    async def _heartbeat_tasks(self) -> None:
        """Tell JetStream that running tasks are alive, so AckWait never redelivers them."""
        for task_id, msg in list(self.msgs.items()):
            if task_id not in self.state.pending or self.state.pending[task_id].inputs is None:
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _tick_forever(self) -> None:
        period = max(0.5, min(5.0, self.settings.ack_wait_s / 3))
        while True:
            await asyncio.sleep(period)  # a timer, not synchronisation
            await self.inbox.put(Tick())

    async def _shutdown(self) -> None:
        log.info("worker %s stopping", self.state.node_id)
        self._apply(ev.Stopping())
        for task_id, msg in list(self.msgs.items()):
            if task_id in self.state.pending:
                with contextlib.suppress(Exception):
                    await msg.nak()  # not started here: let another worker take it now
                self.spans.settled(task_id, "nak")
        await self.runners.stop_all(timeout=10.0)
        await self.background.cancel_all()
        await self.puller.close()
        await self.cluster.stop()
        await telemetry.flush()
        with contextlib.suppress(Exception):
            await self.nc.drain()


def _streams_only(item: Any) -> bool:
    """A runner's chunk changes nothing the planner reads: skip planning on the token path."""
    return isinstance(item, tuple) and isinstance(item[1], STREAMED_REPORTS)


STREAMED_REPORTS = (TaskAccepted, TokenChunk, ToolCallChunk, pipe.TaskRunning, pipe.SpanBatch)

_LIFECYCLE = {
    "connect_to_group": pipe.ConnectToGroup,
    "load_model": pipe.LoadModel,
    "warm_up": pipe.WarmUp,
}
