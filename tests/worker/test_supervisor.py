"""RunnerProcess with real runner subprocesses (the fault engine: plumbing only) and backoff."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.runner.fault_engine import fault_card
from fleet.wire.cluster import ModelCard
from fleet.wire.codec import encode
from fleet.wire.events import ErrorReason, TaskFinished, TokenChunk
from fleet.wire.framing import decode_report
from fleet.wire.pipe import (
    ConnectToGroup,
    LoadModel,
    RunnerSpec,
    RunnerStatusReport,
    SpanBatch,
    SubmitTask,
    WarmUp,
)
from fleet.wire.runners import (
    RunnerFailed,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerShuttingDown,
)
from fleet.wire.tasks import CancelTask, TextGeneration
from fleet.wire.token_frames import TokenFrame
from fleet.worker.inbox import RunnerExited, RunnerReported
from fleet.worker.plan import compute_backoff
from fleet.worker.supervisor import RunnerNotRunning, RunnerProcess, describe_exit

# Generous: each runner imports pydantic, fleet and (the real one) mlx-lm; on two cores beside
# the rest of the suite or a CPU hog that took over 20 s. A wait on a report, not a sleep.
WAIT_S = 90.0


def make_spec(card: ModelCard | None = None, model_path: str = "/nowhere") -> RunnerSpec:
    return RunnerSpec(
        runner_id="run-1",
        instance_id="inst-1",
        node_id="node-a",
        card=card or fault_card(),
        model_path=model_path,
        images_dir="/tmp",
    )


def submit(task_id: str, prompt: str, model: str = "fault-llm", **fields: Any) -> SubmitTask:
    return SubmitTask(task=TextGeneration(task_id=task_id, model=model, prompt=prompt, **fields))


class Runner:
    """A RunnerProcess and everything it reported, read with timeouts (never sleeps)."""

    def __init__(self, process: RunnerProcess, reports: asyncio.Queue[Any]) -> None:
        self.process = process
        self._reports = reports
        self.seen: list[Any] = []
        self.frames: list[tuple[Any, bytes | None]] = []  # each report and the bytes it kept

    async def until(self, done: Callable[[Any], bool]) -> list[Any]:
        """Reports up to and including the first one for which `done` holds."""
        got: list[Any] = []
        pending: list[Any] = []
        while True:
            if not pending:
                item = await asyncio.wait_for(self._reports.get(), WAIT_S)
                assert item.runner_id == "run-1"
                # A terminal's tail (token events read with it, fleet.worker.tails) first.
                pending = ([*item.tail, item.report] if isinstance(item, RunnerReported)
                           else [item])
            report = pending.pop(0)
            if not isinstance(report, RunnerExited):
                frame = report.body if isinstance(report, TokenFrame) else None
                if frame is not None:  # a token event reaches the worker as its bytes
                    report = decode_report(frame)
                self.frames.append((report, frame))
            if isinstance(report, SpanBatch):
                continue  # telemetry, interleaved; tests/runner/test_spans.py checks it
            got.append(report)
            self.seen.append(report)
            if done(report):
                return got

    async def until_exit(self) -> list[Any]:
        return await self.until(lambda r: isinstance(r, RunnerExited))

    async def until_status(self, state: str) -> list[Any]:
        return await self.until(
            lambda r: isinstance(r, RunnerStatusReport) and r.status.state == state
        )

    async def bring_up(self) -> None:
        for command in (ConnectToGroup(), LoadModel(), WarmUp()):
            await self.process.send(command)
        await self.until_status("ready")


class Owner:
    """The pump's owner in these tests (the worker's Supervisor in production)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, name: str, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        return task


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "runner.log"


@pytest.fixture
async def runner(log_path: Path) -> AsyncIterator[Runner]:
    reports: asyncio.Queue[Any] = asyncio.Queue()
    process = RunnerProcess(make_spec(), reports, log_path=log_path)
    await process.start(Owner())
    yield Runner(process, reports)
    if process.returncode is None:
        await process.kill()


def statuses(reports: list[Any]) -> list[str]:
    return [r.status.state for r in reports if isinstance(r, RunnerStatusReport)]


def flattened(reports: list[Any]) -> list[str]:
    """Each report's type, a token event once per token it carries (tokens made close together
    travel in one event), after checking that the tokens' indexes run 0..n-1 without a gap."""
    tokens = [r for r in reports if isinstance(r, TokenChunk)]
    indexes = [i for t in tokens for i in range(t.index, t.next_index)]
    assert indexes == list(range(len(indexes))), indexes
    return [t for r in reports for t in ([r.type] * (r.count if isinstance(r, TokenChunk) else 1))]


def finished(reports: list[Any]) -> list[TaskFinished]:
    return [r for r in reports if isinstance(r, TaskFinished)]


async def test_lifecycle_one_task_and_a_clean_stop(runner: Runner, log_path: Path) -> None:
    await runner.bring_up()
    await runner.process.send(submit("t1", "hello tokens:3"))
    task = await runner.until(lambda r: isinstance(r, TaskFinished))
    assert flattened(task) == [
        "runner_status",
        "token",
        "token",
        "token",
        "task_finished",
    ]
    assert task[-1].status == "completed" and task[-1].runner_id == "run-1"
    # A token event keeps the runner's bytes, which the worker publishes as they are: the
    # very bytes re-encoding it gave. Nothing else keeps them.
    kept = [(report, frame) for report, frame in runner.frames if frame is not None]
    assert kept and all(isinstance(report, TokenChunk) for report, _ in kept)
    assert all(frame == encode(report) for report, frame in kept)
    assert len(kept) == len([r for r, _ in runner.frames if isinstance(r, TokenChunk)])
    assert await runner.until_status("ready")
    assert await runner.process.stop(timeout=WAIT_S) == 0
    assert statuses(await runner.until_exit()) == ["shutting_down", "shutdown"]
    assert runner.seen[-1] == RunnerExited("run-1", 0, "exited with code 0")
    assert statuses(runner.seen)[:3] == ["connecting", "connected", "loading"]
    # The engine printed to stdout on purpose; it reached the log, not the frame pipe.
    assert "a stray print, on purpose" in log_path.read_text()


async def test_a_cancel_lands_during_the_step_that_is_running(runner: Runner) -> None:
    await runner.bring_up()
    await runner.process.send(submit("t1", "tokens:100 delay_ms:500"))
    await runner.until(lambda r: isinstance(r, TokenChunk))
    # The runner is inside its next 500 ms step now; the pipe reader hands the cancel to the
    # engine at once, so that step ends the task instead of making another token.
    await runner.process.send(CancelTask(task_id="t1"))
    end = await runner.until(lambda r: isinstance(r, TaskFinished))
    assert [(r.type, getattr(r, "reason", None)) for r in end] == [
        ("task_finished", ErrorReason.CANCELLED)
    ]
    assert await runner.until_status("ready")


async def test_sigkill_mid_task_reports_failed_then_exited(runner: Runner) -> None:
    """The tasks in flight are the worker's to end (from WorkerState): the process only says
    it failed and that it is gone, and refuses any later command."""
    await runner.bring_up()
    await runner.process.send(submit("a", "tokens:100000 delay_ms:10"))
    await runner.process.send(submit("b", "tokens:100000 delay_ms:10"))
    # Both running: the count follows at the end of the step that made b's first token.
    await runner.until(lambda r: isinstance(r, RunnerStatusReport)
                       and r.status == RunnerRunning(active_tasks=2))
    os.kill(runner.process.pid or 0, signal.SIGKILL)
    after = await runner.until_exit()
    after = [r for r in after if not isinstance(r, TokenChunk)]
    assert after == [
        RunnerStatusReport(status=RunnerFailed(error="runner killed by SIGKILL")),
        RunnerExited("run-1", -signal.SIGKILL, "killed by SIGKILL"),
    ]
    with pytest.raises(RunnerNotRunning):
        await runner.process.send(submit("c", "tokens:1"))


async def test_a_command_to_a_runner_whose_pipe_closed_raises(runner: Runner) -> None:
    """A dispatch racing the runner's death is not swallowed: the sender learns of it."""
    await runner.bring_up()
    os.kill(runner.process.pid or 0, signal.SIGKILL)
    with pytest.raises(RunnerNotRunning):
        for _ in range(1000):  # until the kernel has closed the pipe (bounded)
            await runner.process.send(submit("late", "tokens:1"))
            await asyncio.sleep(0.01)  # yield so the pump can see the exit, not a sync wait
    assert (await runner.until_exit())[-1].returncode == -signal.SIGKILL


async def test_an_engine_crash_is_told_once_by_the_runner_itself(runner: Runner) -> None:
    await runner.bring_up()
    await runner.process.send(submit("t1", "crash_after:2"))
    after = await runner.until_exit()
    error = "engine step failed: RuntimeError: fault injected: crash after 2 tokens"
    assert [(r.task_id, r.reason, r.message) for r in finished(after)] == [
        ("t1", ErrorReason.INTERNAL, f"runner failed: {error}")
    ]
    told = [r.status for r in after if isinstance(r, RunnerStatusReport)]
    assert told == [RunnerRunning(active_tasks=1), RunnerFailed(error=error)]
    assert after[-1] == RunnerExited("run-1", 1, "exited with code 1")


async def test_closing_stdin_makes_the_runner_exit_cleanly(runner: Runner) -> None:
    await runner.bring_up()
    stdin = runner.process._process.stdin  # type: ignore[union-attr]  # the worker dying
    assert stdin is not None
    stdin.close()
    after = await runner.until_exit()
    assert after == [
        RunnerStatusReport(status=RunnerShuttingDown()),
        RunnerStatusReport(status=RunnerShutdown()),
        RunnerExited("run-1", 0, "exited with code 0"),
    ]


async def test_stop_kills_a_runner_that_does_not_stop_in_time(runner: Runner) -> None:
    await runner.bring_up()
    await runner.process.send(submit("t1", "tokens:2 delay_ms:60000"))
    await runner.until(lambda r: r.type == "runner_status")  # running
    assert await runner.process.stop(timeout=0.5) == -signal.SIGKILL
    after = await runner.until_exit()
    assert finished(after) == []  # the worker ends t1 from its own state
    # Asked for: no RunnerFailed, the last status stays what the runner said.
    assert statuses(after) == []
    assert after[-1] == RunnerExited("run-1", -signal.SIGKILL, "killed by SIGKILL")


async def test_a_failed_load_reports_failed_and_exits_non_zero(log_path: Path) -> None:
    reports: asyncio.Queue[Any] = asyncio.Queue()
    process = RunnerProcess(
        make_spec(), reports, env={"FLEET_FAULT_LOAD_FAIL": "1"}, log_path=log_path
    )
    await process.start(Owner())
    runner = Runner(process, reports)
    await process.send(ConnectToGroup())
    await process.send(LoadModel())
    after = await runner.until_exit()
    error = "load_model failed: RuntimeError: fault injected: loading failed"
    assert after[-2:] == [
        RunnerStatusReport(status=RunnerFailed(error=error)),
        RunnerExited("run-1", 1, "exited with code 1"),
    ]


async def test_the_text_engine_in_a_real_runner(tiny_llm_dir: Path, log_path: Path) -> None:
    card = ModelCard(
        id="tiny-llm",
        name="tiny-llm",
        tasks=["text_generation"],
        family="mlx_lm",
        source="built-in",
        n_layers=2,
    )
    reports: asyncio.Queue[Any] = asyncio.Queue()
    process = RunnerProcess(make_spec(card, str(tiny_llm_dir)), reports, log_path=log_path)
    await process.start(Owner())
    runner = Runner(process, reports)
    try:
        await runner.bring_up()
        await process.send(submit("t1", "hello", model="tiny-llm", max_tokens=4, temperature=0))
        task = await runner.until(lambda r: isinstance(r, TaskFinished))
        assert flattened(task) == ["runner_status"] + [
            "token"
        ] * 4 + ["task_finished"]
        assert task[-1].status == "completed"
        assert await runner.until_status("ready") == [RunnerStatusReport(status=RunnerReady())]
        assert await process.stop(timeout=WAIT_S) == 0
        assert "BLAS: " in log_path.read_text()  # the OpenBLAS choice ran before mlx loaded
    finally:
        if process.returncode is None:
            await process.kill()


@pytest.mark.parametrize(
    ("attempts", "delay"),
    [(-1, 0.0), (0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (10_000, 60.0)],
)
def test_compute_backoff(attempts: int, delay: float) -> None:
    assert compute_backoff(attempts, base=1.0, cap=60.0) == delay


@pytest.mark.parametrize(
    ("returncode", "words"),
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (-9, "killed by SIGKILL"),
        (-15, "killed by SIGTERM"),
        (-200, "killed by signal 200"),
    ],
)
def test_describe_exit(returncode: int, words: str) -> None:
    assert describe_exit(returncode) == words
