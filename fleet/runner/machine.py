"""The runner's state machine: one `match` over (command, state), one engine, one `emit`.

    Idle → Connecting → Connected → Loading(done/total) → Loaded → WarmingUp → Ready ⇄ Running
    → ShuttingDown → Shutdown, and Failed(error) from anywhere.

The machine owns no thread and no pipe: `handle(command)` and `step()` are called by one loop
(fleet.runner.main in the subprocess, or a test in-process) and every report goes to `emit`.
For each task it emits, in order: RunnerStatusReport(Running) when the runner was not running
already, the engine's chunks, one TaskFinished, then RunnerStatusReport(Ready) once no task
remains. Running's count follows after each step where it changed. (A TaskRunning a task,
which the worker read and dropped, is gone: a frame a task at 64 slots of short tasks.) The task's
`task_accepted` is the worker's, published as it sends the task here (issue 23: waiting for
this process to say so cost the accept a pipe round trip).

A command the current state does not accept is a bug in the sender, surfaced, never ignored:
a task sent at the wrong time ends failed with a message saying why; any other stray command
fails the runner, and the worker restarts it into a state both sides agree on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fleet.errors import TaskRejected
from fleet.runner.company import Gathering
from fleet.runner.engine import Admission, Engine, GroupLost, Token
from fleet.wire.events import ErrorReason, TaskFinished, failed
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    Shutdown,
    SubmitTask,
    WarmUp,
)
from fleet.wire.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerShuttingDown,
    RunnerStatus,
    RunnerWarmingUp,
)
from fleet.wire.tasks import CancelTask

log = logging.getLogger(__name__)

Emit = Callable[[RunnerReport | Token], None]  # a plain token as its engine made it


class UnexpectedCommand(Exception):
    """A command the current state does not accept."""


class RunnerMachine:
    def __init__(
        self,
        spec: RunnerSpec,
        engine: Engine,
        emit: Emit,
        clock: Callable[[], float] = time.time,
        connect: Callable[[], None] = lambda: None,
    ) -> None:
        """`connect` joins the runner's group (a sharded instance); one node has none."""
        self._spec = spec
        self._connect = connect
        self._engine = engine
        self._emit = emit
        self._clock = clock
        self.state: RunnerStatus = RunnerIdle()
        self._in_flight: dict[str, None] = {}  # task ids in arrival order
        # Running(n) and Ready are reported about once a pass each under short tasks: made
        # once (wire models are frozen), not two validated models a report.
        self._running: dict[int, RunnerStatusReport] = {}

    @property
    def company_share(self) -> float:
        """The engine's wait for company, a share of its step (fleet.runner.company)."""
        return self._engine.company_share if isinstance(self._engine, Gathering) else 0.0

    @property
    def busy(self) -> bool:
        """Tasks are in flight: the loop must keep calling `step()`."""
        return bool(self._in_flight)

    @property
    def done(self) -> bool:
        return isinstance(self.state, RunnerShutdown | RunnerFailed)

    @property
    def exit_code(self) -> int:
        return 0 if isinstance(self.state, RunnerShutdown) else 1

    def handle(self, command: RunnerCommand) -> None:
        if self.done:
            raise RuntimeError(f"the runner is {self.state.state}: its loop must have ended")
        try:
            self._transition(command)
        except UnexpectedCommand as exc:
            log.error("%s", exc)
            self.fail(str(exc))
        except Exception as exc:
            log.exception("%s failed", command.type)
            self.fail(f"{command.type} failed: {type(exc).__name__}: {exc}")

    def _transition(self, command: RunnerCommand) -> None:
        match command, self.state:
            case ConnectToGroup(), RunnerIdle():
                self._become(RunnerConnecting())
                with _timed("joined its group" if self._spec.group else "connected"):
                    self._connect()
                self._become(RunnerConnected())
            case LoadModel(), RunnerConnected():
                self._become(RunnerLoading(layers_total=self._spec.card.n_layers))
                with _timed("loaded the model"):
                    self._engine.load(self._loading)
                self._become(RunnerLoaded())
            case WarmUp(), RunnerLoaded():
                self._become(RunnerWarmingUp())
                with _timed("warmed up"):
                    self._engine.warm_up()
                self._become(RunnerReady())
            case SubmitTask(task=task), RunnerReady() | RunnerRunning() if (
                task.task_id in self._in_flight
            ):
                raise UnexpectedCommand(f"task {task.task_id} was submitted twice")
            case SubmitTask(), RunnerReady() | RunnerRunning():
                self._start(command)
            case SubmitTask(task=task), _:
                self._refuse(task.task_id, f"the runner is {self.state.state}, not ready")
            case CancelTask(task_id=task_id), RunnerRunning() | RunnerShuttingDown():
                if task_id in self._in_flight:
                    self._engine.cancel(task_id)
            case CancelTask(), RunnerReady():
                pass  # the task finished already: a cancel racing a task's end is normal
            case Shutdown(), RunnerShuttingDown():
                pass  # already on the way out (an explicit Shutdown, then the pipe closing)
            case Shutdown(), RunnerRunning():
                self._become(RunnerShuttingDown())
                for task_id in self._in_flight:
                    self._engine.cancel(task_id)
            case Shutdown(), _:
                self._become(RunnerShuttingDown())
                self._close()
            case _:
                raise UnexpectedCommand(
                    f"{command.type} is not accepted while the runner is {self.state.state}"
                )

    def step(self) -> None:
        """Advance every task one engine step and emit what it produced."""
        try:
            events = self._engine.step()
        except GroupLost:
            raise  # the process exits as crashed: the worker ends or continues its tasks
        except Exception as exc:
            log.exception("engine step failed")
            self.fail(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        for event in events:
            if isinstance(event, TaskFinished):
                self._in_flight.pop(event.task_id, None)
                event = self._signed(event)
            self._emit(event)
        if self._in_flight and self._engine.active == 0:
            self._fail_tasks("the engine dropped the task without finishing it")
        self._settle()

    def fail(self, error: str) -> None:
        """End every task in flight as failed (internal) and report the runner Failed."""
        self._fail_tasks(f"runner failed: {error}")
        self._become(RunnerFailed(error=error))

    def _loading(self, layers_done: int, layers_total: int) -> None:
        loading = RunnerLoading(layers_done=layers_done, layers_total=layers_total)
        if loading != self.state:
            self._become(loading)

    def _start(self, command: SubmitTask) -> None:
        task = command.task
        self._in_flight[task.task_id] = None
        if not isinstance(self.state, RunnerRunning):
            # Once, as it leaves Ready: the count then follows once a step (`_settle`), not
            # once a task; at 64 slots of short tasks a report a task cost the runner and its
            # worker a frame each (issue 23). The worker counts its tasks itself.
            self._become_running()
        admission = Admission(
            task=task,
            inputs={sha: Path(path) for sha, path in command.inputs.items()},
            queue_wait_s=command.queue_wait_s,
            generated=tuple(command.generated),
            delivered_images=frozenset(command.delivered_images),
            traceparent=command.traceparent,
            tracestate=command.tracestate,
        )
        try:
            self._engine.admit(admission)
        except TaskRejected as exc:
            self._in_flight.pop(task.task_id)
            self._emit(self._signed(failed(task.task_id, self._clock(), exc.reason, exc.message)))
            self._settle()

    def _refuse(self, task_id: str, why: str) -> None:
        message = f"runner {self._spec.runner_id} cannot run task {task_id}: {why}"
        log.error("%s", message)
        self._emit(self._signed(failed(task_id, self._clock(), ErrorReason.INTERNAL, message)))

    def _fail_tasks(self, message: str) -> None:
        for task_id in list(self._in_flight):
            self._emit(self._signed(failed(task_id, self._clock(), ErrorReason.INTERNAL, message)))
        self._in_flight.clear()

    def _settle(self) -> None:
        """After tasks ended: report the new count, Ready, or finish a pending shutdown."""
        match self.state:
            case RunnerRunning(active_tasks=shown) if self._in_flight:
                if shown != len(self._in_flight):
                    self._become_running()
            case RunnerRunning():
                self.state = _READY.status
                self._emit(_READY)
            case RunnerShuttingDown() if not self._in_flight:
                self._close()

    def _close(self) -> None:
        try:
            self._engine.close()
        except Exception:
            log.exception("closing the engine failed; the process exits anyway")
        self._become(RunnerShutdown())

    def _signed(self, finished: TaskFinished) -> TaskFinished:
        """The terminal event names where the task ran, whoever made it."""
        return finished.model_copy(
            update={
                "node_id": finished.node_id or self._spec.node_id,
                "runner_id": finished.runner_id or self._spec.runner_id,
            }
        )

    def _become(self, status: RunnerStatus) -> None:
        self.state = status
        self._emit(RunnerStatusReport(status=status))

    def _become_running(self) -> None:
        """Running with the count in flight now."""
        active = len(self._in_flight)
        report = self._running.get(active)
        if report is None:
            report = self._running[active] = RunnerStatusReport(
                status=RunnerRunning(active_tasks=active))
        self.state = report.status
        self._emit(report)


_READY = RunnerStatusReport(status=RunnerReady())


@contextlib.contextmanager
def _timed(what: str) -> Iterator[None]:
    """Log how long a lifecycle step took: a runner's start (a restarted shard's above all)
    is the sum of these, and the log is where an operator finds which one was slow."""
    began = time.monotonic()
    yield
    log.info("%s in %.2f s", what, time.monotonic() - began)
