"""One runner subprocess: spawn it, talk to it over its pipes, report how it ended.

Every report the runner writes goes into the worker's queue as `(runner_id, report)`. The
supervisor remembers which tasks it sent and has not yet seen finish, so that when the process
dies (a crash, a signal, the OOM killer) each of them still ends: a TaskFinished failed with
reason runner_crashed naming the exit code or signal. Then, unless the exit was a clean
shutdown or one asked for by `stop()` / `kill()`, a RunnerStatusReport(RunnerFailed), and last,
always, the sentinel `RunnerExited` - nothing more comes from this runner after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fleet.runner.framing import FrameError, decode_report, read_frame, write_frame
from fleet.runner.protocol import (
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    Shutdown,
    SubmitTask,
)
from fleet.wire.codec import DecodeError, encode
from fleet.wire.events import ErrorReason, TaskFinished, failed
from fleet.wire.runners import RunnerFailed, RunnerShutdown, RunnerStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerExited:
    """The last item a RunnerProcess puts in the queue: its process is gone."""

    runner_id: str
    returncode: int


Reports = asyncio.Queue[tuple[str, RunnerReport | RunnerExited]]


class RunnerNotRunning(Exception):
    """A command for a runner whose process has exited (or never started)."""


def compute_backoff(attempts: int, base: float, cap: float) -> float:
    """Seconds to wait before restart number `attempts`: 0 for the first start, then
    base, 2·base, 4·base … up to cap. Pure: the caller adds it to its own `now`."""
    if attempts <= 0:
        return 0.0
    return min(cap, base * 2.0 ** min(attempts - 1, 64))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class RunnerProcess:
    def __init__(
        self,
        spec: RunnerSpec,
        reports: Reports,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        """`env` is added to (and overrides) the worker's own environment; the runner's
        stderr goes to `log_path` (appended) or, without one, to the worker's stderr."""
        self.spec = spec
        self.runner_id = spec.runner_id
        self._reports = reports
        self._env = env
        self._log_path = log_path
        self._process: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._in_flight: dict[str, None] = {}
        self._exited = False
        self._stop_requested = False
        self.status: RunnerStatus | None = None  # the last status the runner reported

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode if self._process else None

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._in_flight)

    async def start(self) -> None:
        env = {**os.environ, **(self._env or {})}
        args = [sys.executable, "-m", "fleet.runner.main", encode(self.spec).decode()]
        stderr = self._log_path.open("ab") if self._log_path else None
        try:
            self._process = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        finally:
            if stderr is not None:
                stderr.close()  # the child holds its own copy
        log.info("runner %s started, pid %d", self.runner_id, self._process.pid)
        self._pump = asyncio.create_task(self._pump_reports(), name=f"runner-{self.runner_id}")

    async def send(self, command: RunnerCommand) -> None:
        """Write one command. Raises RunnerNotRunning when the process has already exited; a
        task sent as the runner dies is not lost: it ends runner_crashed like the others."""
        if self._process is None or self._process.stdin is None or self._exited:
            raise RunnerNotRunning(f"runner {self.runner_id} is not running")
        if isinstance(command, SubmitTask):
            self._in_flight[command.task.task_id] = None
        try:
            async with self._write_lock:
                await write_frame(self._process.stdin, command)
        except (BrokenPipeError, ConnectionResetError):
            log.warning("runner %s: pipe closed while sending %s", self.runner_id, command.type)

    async def stop(self, timeout: float = 10.0) -> int:
        """Ask the runner to shut down; kill it if it has not exited within `timeout`."""
        self._stop_requested = True
        if self._process is None or self._pump is None:
            raise RunnerNotRunning(f"runner {self.runner_id} was never started")
        with contextlib.suppress(RunnerNotRunning):  # already gone: just collect its end
            await self.send(Shutdown())
        try:
            await asyncio.wait_for(asyncio.shield(self._pump), timeout)
        except TimeoutError:
            log.warning("runner %s did not stop within %.1fs: killing it", self.runner_id, timeout)
            return await self.kill()
        return self._process.returncode or 0

    async def kill(self) -> int:
        """SIGKILL the runner (a deliberate stop: no RunnerFailed) and wait for its end."""
        self._stop_requested = True
        if self._process is None or self._pump is None:
            raise RunnerNotRunning(f"runner {self.runner_id} was never started")
        if self._process.returncode is None:
            self._process.kill()
        await self._pump
        return self._process.returncode or 0

    async def _pump_reports(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        try:
            while (body := await read_frame(self._process.stdout)) is not None:
                report = decode_report(body)
                self._observe(report)
                await self._reports.put((self.runner_id, report))
        except (FrameError, DecodeError) as exc:
            log.error("runner %s wrote an invalid frame (%s): killing it", self.runner_id, exc)
            self._process.kill()
        returncode = await self._process.wait()
        await self._report_exit(returncode)

    def _observe(self, report: RunnerReport) -> None:
        if isinstance(report, TaskFinished):
            self._in_flight.pop(report.task_id, None)
        elif isinstance(report, RunnerStatusReport):
            self.status = report.status

    async def _report_exit(self, returncode: int) -> None:
        # No await until the flag is set and the tasks are taken: a concurrent send() either
        # sees the exit and raises, or its task is among those ended here.
        self._exited = True
        lost, self._in_flight = list(self._in_flight), {}
        how = describe_exit(returncode)
        log.log(
            logging.INFO if returncode == 0 else logging.WARNING,
            "runner %s %s",
            self.runner_id,
            how,
        )
        for task_id in lost:
            message = f"runner {self.runner_id} {how} while running this task"
            finished = failed(task_id, time.time(), ErrorReason.RUNNER_CRASHED, message)
            update = {"node_id": self.spec.node_id, "runner_id": self.runner_id}
            await self._reports.put((self.runner_id, finished.model_copy(update=update)))
        clean = returncode == 0 and isinstance(self.status, RunnerShutdown)
        already_told = isinstance(self.status, RunnerFailed)
        if not (clean or already_told or self._stop_requested):
            self.status = RunnerFailed(error=f"runner {how}")
            await self._reports.put((self.runner_id, RunnerStatusReport(status=self.status)))
        await self._reports.put((self.runner_id, RunnerExited(self.runner_id, returncode)))
