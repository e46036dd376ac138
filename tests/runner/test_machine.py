"""The runner's state machine, in-process: whole event sequences, compared as one list.

The fault engine proves the plumbing only; the TextEngine test on tiny-llm is the real one.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from fleet.runner.engine import EngineConfig, Token
from fleet.runner.fault_engine import FaultEngine, fault_card, parse_knobs
from fleet.runner.machine import RunnerMachine
from fleet.runner.main import Inbox, PipeBroken, engine_config, serve
from fleet.telemetry import trace_id_of
from fleet.wire.cluster import ModelCard
from fleet.wire.events import ErrorReason, TaskFinished, TokenChunk, Usage
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
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
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerShuttingDown,
    RunnerStatus,
    RunnerWarmingUp,
)
from fleet.wire.tasks import CancelTask, TextGeneration

AT = 1_700_000_000.0
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
WHERE = {"node_id": "node-a", "runner_id": "run-1"}


def make_spec(card: ModelCard, model_path: str = "/nowhere") -> RunnerSpec:
    return RunnerSpec(
        runner_id="run-1",
        instance_id="inst-1",
        node_id="node-a",
        card=card,
        model_path=model_path,
        images_dir="/tmp",
        slots=4,
    )


def status(state: RunnerStatus) -> RunnerStatusReport:
    return RunnerStatusReport(status=state)


def submit(task_id: str, prompt: str, **fields: Any) -> SubmitTask:
    return SubmitTask(
        task=TextGeneration(task_id=task_id, model="fault-llm", prompt=prompt), **fields
    )


def token(task_id: str, index: int) -> Token:
    """A fault-engine token as the engine reports it (the coalescer makes the wire event)."""
    return Token(task_id, AT, index, index, f" t{index}")


def ended(task_id: str, status: Any, reason: ErrorReason, message: str) -> TaskFinished:
    return TaskFinished(
        task_id=task_id, at=AT, status=status, reason=reason, message=message, **WHERE
    )


class Recorder:
    """The machine's `emit`, and the reports so far; `take()` returns the new ones."""

    def __init__(self) -> None:
        self.reports: list[Any] = []
        self._seen = 0

    def __call__(self, report: Any) -> None:
        self.reports.append(report)

    def take(self) -> list[Any]:
        new, self._seen = self.reports[self._seen :], len(self.reports)
        return new


LIFECYCLE = [
    status(RunnerConnecting()),
    status(RunnerConnected()),
    status(RunnerLoading(layers_done=0, layers_total=2)),
    status(RunnerLoading(layers_done=1, layers_total=2)),
    status(RunnerLoading(layers_done=2, layers_total=2)),
    status(RunnerLoaded()),
    status(RunnerWarmingUp()),
    status(RunnerReady()),
]


def bring_up(machine: RunnerMachine) -> None:
    for command in (ConnectToGroup(), LoadModel(), WarmUp()):
        if machine.done:
            return
        machine.handle(command)


@pytest.fixture
def emitted() -> Recorder:
    return Recorder()


@pytest.fixture
def machine(emitted: Recorder) -> RunnerMachine:
    spec = make_spec(fault_card())
    config = EngineConfig(card=spec.card, model_path=Path("/nowhere"), slots=2, images_dir=Path())
    engine = FaultEngine(config, clock=lambda: AT, sleep=lambda _: None)
    return RunnerMachine(spec, engine, emitted, clock=lambda: AT)


@pytest.fixture
def ready(machine: RunnerMachine, emitted: Recorder) -> RunnerMachine:
    bring_up(machine)
    assert emitted.take() == LIFECYCLE
    return machine


def run_until_idle(machine: RunnerMachine) -> None:
    for _ in range(100):
        if not machine.busy:
            return
        machine.step()
    raise AssertionError("the machine never became idle")


def test_one_task_from_idle_to_ready_again(machine: RunnerMachine, emitted: Recorder) -> None:
    bring_up(machine)
    traceparent = f"00-{TRACE}-00f067aa0ba902b7-01"
    machine.handle(submit("t1", "hello tokens:3", traceparent=traceparent, delivery=2))
    run_until_idle(machine)
    assert emitted.take() == [
        *LIFECYCLE,
        status(RunnerRunning(active_tasks=1)),
        token("t1", 0),
        token("t1", 1),
        token("t1", 2),
        TaskFinished(
            task_id="t1",
            at=AT,
            status="completed",
            finish_reason="stop",
            usage=Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5),
            **WHERE,
        ),
        status(RunnerReady()),
    ]


def test_a_task_in_the_wrong_state_ends_failed_and_the_state_stays(
    machine: RunnerMachine, emitted: Recorder
) -> None:
    machine.handle(ConnectToGroup())
    machine.handle(submit("early", "hello"))
    message = "runner run-1 cannot run task early: the runner is connected, not ready"
    assert emitted.take()[-1] == ended("early", "failed", ErrorReason.INTERNAL, message)
    assert machine.state == RunnerConnected()
    machine.handle(LoadModel())  # still usable
    assert machine.state == RunnerLoaded()


@pytest.mark.parametrize("command", [LoadModel(), ConnectToGroup(), WarmUp()])
def test_a_stray_lifecycle_command_fails_the_runner(
    ready: RunnerMachine, emitted: Recorder, command: Any
) -> None:
    ready.handle(command)
    error = f"{command.type} is not accepted while the runner is ready"
    assert emitted.take() == [status(RunnerFailed(error=error))]
    assert ready.done and ready.exit_code == 1


def test_a_cancel_before_any_task_can_exist_is_an_error(
    machine: RunnerMachine, emitted: Recorder
) -> None:
    machine.handle(CancelTask(task_id="t1"))
    error = "cancel_task is not accepted while the runner is idle"
    assert emitted.take() == [status(RunnerFailed(error=error))]


def test_a_rejected_task_ends_failed_after_it_started_running(
    ready: RunnerMachine, emitted: Recorder
) -> None:
    ready.handle(submit("t1", "reject:context_length"))
    assert emitted.take() == [
        status(RunnerRunning(active_tasks=1)),
        ended(
            "t1", "failed", ErrorReason.CONTEXT_LENGTH, "fault injected: rejected as context_length"
        ),
        status(RunnerReady()),
    ]
    assert not ready.busy


def test_cancel_mid_task(ready: RunnerMachine, emitted: Recorder) -> None:
    ready.handle(submit("t1", "tokens:100"))
    ready.step()
    ready.handle(CancelTask(task_id="t1"))
    run_until_idle(ready)
    assert emitted.take()[1:] == [  # after its Running status
        token("t1", 0),
        ended("t1", "cancelled", ErrorReason.CANCELLED, "cancelled"),
        status(RunnerReady()),
    ]
    ready.handle(CancelTask(task_id="t1"))  # racing the end: harmless
    assert emitted.take() == []


def test_tasks_share_the_runner_and_the_count_follows_each_step(
    ready: RunnerMachine, emitted: Recorder
) -> None:
    """Running once as the runner leaves Ready; its count after each step that changed it,
    not at each task's start (a frame a task at 64 slots of short tasks)."""
    ready.handle(submit("a", "tokens:3"))
    ready.step()
    ready.handle(submit("b", "tokens:2"))
    run_until_idle(ready)
    kinds = [(r.type, getattr(r, "task_id", None) or r.status) for r in emitted.take()]
    assert kinds == [
        ("runner_status", RunnerRunning(active_tasks=1)),
        ("token", "a"),
        ("token", "a"),  # b started: no report of its own, the count changes at the step's end
        ("token", "b"),
        ("runner_status", RunnerRunning(active_tasks=2)),
        ("token", "a"),
        ("task_finished", "a"),
        ("token", "b"),
        ("task_finished", "b"),
        ("runner_status", RunnerReady()),
    ]


def test_an_engine_crash_fails_every_task_in_flight(
    ready: RunnerMachine, emitted: Recorder
) -> None:
    ready.handle(submit("a", "tokens:9"))
    ready.handle(submit("b", "crash_after:1 tokens:9"))
    ready.step()
    emitted.take()
    ready.step()
    error = "engine step failed: RuntimeError: fault injected: crash after 1 tokens"
    assert emitted.take() == [
        ended("a", "failed", ErrorReason.INTERNAL, f"runner failed: {error}"),
        ended("b", "failed", ErrorReason.INTERNAL, f"runner failed: {error}"),
        status(RunnerFailed(error=error)),
    ]
    assert ready.done and ready.exit_code == 1 and not ready.busy


def test_a_task_submitted_twice_fails_the_runner(ready: RunnerMachine, emitted: Recorder) -> None:
    ready.handle(submit("a", "tokens:9"))
    ready.handle(submit("a", "tokens:9"))
    error = "task a was submitted twice"
    assert emitted.take()[1:] == [  # after its Running status
        ended("a", "failed", ErrorReason.INTERNAL, f"runner failed: {error}"),
        status(RunnerFailed(error=error)),
    ]


def test_shutdown_while_running_cancels_then_shuts_down(
    ready: RunnerMachine, emitted: Recorder
) -> None:
    ready.handle(submit("t1", "tokens:100"))
    emitted.take()
    ready.handle(Shutdown())
    ready.handle(Shutdown())  # the pipe closing right after: already on the way out
    run_until_idle(ready)
    assert emitted.take() == [
        status(RunnerShuttingDown()),
        ended("t1", "cancelled", ErrorReason.CANCELLED, "cancelled"),
        status(RunnerShutdown()),
    ]
    assert ready.done and ready.exit_code == 0


def test_a_failed_load_fails_the_runner(
    machine: RunnerMachine, emitted: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_FAULT_LOAD_FAIL", "1")
    bring_up(machine)
    error = "load_model failed: RuntimeError: fault injected: loading failed"
    assert emitted.take()[-1] == status(RunnerFailed(error=error))
    assert machine.done


def test_the_loop_drains_commands_and_steps_until_shutdown() -> None:
    inbox: Inbox = queue.Queue()
    reports: list[Any] = []

    def emit(report: Any) -> None:  # the worker's side: shut down once the task is done
        reports.append(report)
        if isinstance(report, TaskFinished):
            inbox.put(Shutdown())

    spec = make_spec(fault_card())
    config = EngineConfig(card=spec.card, model_path=Path("/nowhere"), slots=2, images_dir=Path())
    engine = FaultEngine(config, clock=lambda: AT, sleep=lambda _: None)
    for command in (ConnectToGroup(), LoadModel(), WarmUp(), submit("t1", "tokens:2")):
        inbox.put(command)
    assert serve(RunnerMachine(spec, engine, emit, clock=lambda: AT), inbox) == 0
    assert [getattr(r, "status", r.type) for r in reports[len(LIFECYCLE) + 1 :]] == [
        "token",
        "token",
        "completed",
        RunnerReady(),
        RunnerShuttingDown(),
        RunnerShutdown(),
    ]


def test_an_unreadable_command_fails_the_runner(machine: RunnerMachine, emitted: Recorder) -> None:
    inbox: Inbox = queue.Queue()
    inbox.put(PipeBroken("unreadable command from the worker: not JSON"))
    assert serve(machine, inbox) == 1
    error = "unreadable command from the worker: not JSON"
    assert emitted.take() == [status(RunnerFailed(error=error))]


@pytest.mark.parametrize(
    ("traceparent", "trace_id"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (None, None),
        ("", None),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),  # the all-zero id is invalid
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),
        (f"00-{TRACE}-00f067aa0ba902b7", None),
    ],
)
def test_trace_id_of(traceparent: str | None, trace_id: str | None) -> None:
    assert trace_id_of(traceparent) == trace_id


def test_fault_knobs() -> None:
    knobs = parse_knobs("say hi tokens:3 delay_ms:20 crash_after:2 reject:unsupported")
    assert (knobs.tokens, knobs.delay_ms, knobs.crash_after) == (3, 20, 2)
    assert knobs.reject is ErrorReason.UNSUPPORTED
    assert parse_knobs("plain text") == type(knobs)()


def test_one_task_on_the_real_text_engine(tiny_llm_dir: Path, emitted: Recorder) -> None:
    from fleet.runner.text import TextEngine

    card = ModelCard(
        id="tiny-llm",
        name="tiny-llm",
        tasks=["text_generation"],
        family="mlx_lm",
        source="built-in",
        n_layers=2,
    )
    spec = make_spec(card, model_path=str(tiny_llm_dir))
    machine = RunnerMachine(spec, TextEngine(engine_config(spec)), emitted)
    bring_up(machine)
    task = TextGeneration(
        task_id="t1", model="tiny-llm", prompt="hello", max_tokens=5, temperature=0
    )
    machine.handle(SubmitTask(task=task, traceparent=f"00-{TRACE}-00f067aa0ba902b7-01"))
    run_until_idle(machine)
    reports = emitted.take()
    assert reports[: len(LIFECYCLE)] == LIFECYCLE
    task_reports = reports[len(LIFECYCLE) :]
    tokens = [r for r in task_reports if isinstance(r, Token | TokenChunk)]
    finished = task_reports[-2]
    assert task_reports == [
        status(RunnerRunning(active_tasks=1)),
        *tokens,
        finished,
        status(RunnerReady()),
    ]
    assert [t.index for t in tokens] == [0, 1, 2, 3, 4]  # greedy on random weights: no EOS
    assert (finished.status, finished.finish_reason, finished.node_id) == (
        "completed",
        "length",
        "node-a",
    )
    assert finished.usage is not None and finished.usage.completion_tokens == 5
