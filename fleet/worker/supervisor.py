"""One runner subprocess: spawn it, talk to it over its pipes, report how it ended.

Every report the runner writes goes into the worker's inbox as `RunnerReported`. When the
process ends (a crash, a signal, the OOM killer, a clean shutdown) there comes, unless the
exit was clean or asked for by `stop()` / `kill()`, a RunnerStatusReport(RunnerFailed), and
last, always, `RunnerExited` - nothing more comes from this runner after it. Which tasks were
still running there is the worker's to know (WorkerState), not this class's: it ends them.

The pump that reads the runner's pipe is a child of the owner given to `start` (the worker's
Supervisor), so it is never an orphan task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

from fleet import telemetry
from fleet.wire.codec import DecodeError, encode
from fleet.wire.events import ErrorReason, TaskFinished, failed
from fleet.wire.framing import (
    READ_BYTES,
    FrameError,
    check_ended,
    encode_message,
    take_frames,
)
from fleet.wire.pipe import (
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    Shutdown,
)
from fleet.wire.runners import RunnerFailed, RunnerShutdown, RunnerStatus
from fleet.wire.token_frames import SpanFrame, TokenFrame, read_report
from fleet.worker.inbox import Inbox, RunnerExited, RunnerReported
from fleet.worker.standby import StandbyRunner
from fleet.worker.tails import with_tails

log = logging.getLogger(__name__)

WRITE_AT_BYTES = 1 << 16  # queued command bytes written at once (the pipe's own high-water mark)


class Owner(Protocol):
    """Who runs the pump: `fleet.aio.Supervisor` in the worker."""

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class RunnerNotRunning(Exception):
    """A command for a runner whose process has exited (or never started)."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def crashed_terminal(task_id: str, exited: RunnerExited, node_id: str) -> TaskFinished:
    """The terminal of a task that was in flight on a runner when it exited."""
    message = f"runner {exited.runner_id} {exited.how} while running this task"
    lost = failed(task_id, time.time(), ErrorReason.RUNNER_CRASHED, message)
    return lost.model_copy(update={"node_id": node_id, "runner_id": exited.runner_id})


class RunnerProcess:
    def __init__(
        self,
        spec: RunnerSpec,
        reports: Inbox,
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
        self._outgoing: list[bytes] = []  # frames `send` queued for the next write
        self._outgoing_bytes = 0
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
    def exited(self) -> bool:
        return self._exited

    async def start(self, owner: Owner, standby: StandbyRunner | None = None) -> None:
        """Start the runner's process, or hand its job to `standby` (a process of this
        runner's id that has done a text runner's imports); a standby that is gone is
        replaced by a fresh start."""
        if standby is not None and await standby.hand(self.spec, self._env or {}):
            standby.adopt_log(self._log_path)
            self._process = standby.process
            log.info("runner %s started from its standby, pid %d", self.runner_id,
                     self._process.pid)
        else:
            self._process = await self._spawn()
            log.info("runner %s started, pid %d", self.runner_id, self._process.pid)
        self._pump = owner.spawn(f"runner {self.runner_id} reports", self._pump_reports())

    async def _spawn(self) -> asyncio.subprocess.Process:
        env = {**os.environ, **(self._env or {})}
        args = [sys.executable, "-m", "fleet.runner.main", encode(self.spec).decode()]
        stderr = self._log_path.open("ab") if self._log_path else None
        try:
            return await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        finally:
            if stderr is not None:
                stderr.close()  # the child holds its own copy

    async def send(self, command: RunnerCommand) -> None:
        """Queue one command for the pipe (written, in order, at the end of the loop's pass).
        Raises RunnerNotRunning when the process has exited or its pipe is closed: then
        RunnerExited is on its way (the pump always ends with it), and the worker ends what
        was in flight there, the task this command carried included. A pipe that breaks
        after the command was queued ends the same way."""
        if self._process is None or self._process.stdin is None or self._exited:
            raise RunnerNotRunning(f"runner {self.runner_id} is not running")
        stdin = self._process.stdin
        if stdin.is_closing():
            raise RunnerNotRunning(f"runner {self.runner_id}: pipe closed, {command.type} "
                                   "not sent")
        # Queued, in order, and written once the loop's pass ends: the planner dispatches a
        # batch of tasks in one pass, and one write of their frames wakes the runner once
        # where a write each cost a system call and a wake-up a task (issue 23).
        self._outgoing.append(encode_message(command))
        self._outgoing_bytes += len(self._outgoing[-1])
        if len(self._outgoing) == 1:
            asyncio.get_running_loop().call_soon(self._write_out)
        if self._outgoing_bytes < WRITE_AT_BYTES:
            return
        self._write_out()  # a large batch goes now, and waits for the pipe's room
        try:
            async with self._write_lock:
                await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise RunnerNotRunning(
                f"runner {self.runner_id}: pipe closed while sending {command.type}"
            ) from exc

    def _write_out(self) -> None:
        """Write what `send` queued, in one write; a pipe that breaks meanwhile ends the
        runner's reports (its RunnerExited follows), so nothing is raised here."""
        frames, self._outgoing, self._outgoing_bytes = self._outgoing, [], 0
        if not frames or self._process is None or self._process.stdin is None:
            return
        try:
            self._process.stdin.write(b"".join(frames))
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            log.warning("runner %s: %d command(s) not written: %s", self.runner_id,
                        len(frames), exc)

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

    def kill_now(self) -> None:
        """SIGKILL without waiting (a runner that no longer reads its pipe); counted as a
        crash, since nobody asked it to stop. Its pump reports the exit."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    async def _pump_reports(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        pending = bytearray()
        try:
            while data := await self._process.stdout.read(READ_BYTES):
                pending += data
                read: list[RunnerReport | TokenFrame] = []
                try:
                    for body in take_frames(pending):
                        report = read_report(body)  # a token event: its bytes, no model built
                        if isinstance(report, SpanFrame):
                            # Telemetry, no report: its spans join the worker's own, unparsed,
                            # held with the task's trace (never queued for the worker's loop).
                            telemetry.export_runner_spans(report.parts)
                            continue
                        self._observe(report)
                        read.append(report)
                finally:  # what was read whole goes to the loop, even before a bad frame
                    # A terminal takes its task's last token events of the same read along
                    # (fleet.worker.tails): one message a task fewer on its stream.
                    for report, tail in with_tails(read):
                        self._reports.put_nowait(RunnerReported(self.runner_id, report, tail))
            check_ended(pending)
        except (FrameError, DecodeError) as exc:
            log.error("runner %s wrote an invalid frame (%s): killing it", self.runner_id, exc)
            self._process.kill()
        except Exception:
            # Whatever broke the pump, the runner must still end with RunnerExited.
            log.exception("runner %s: its report pump failed: killing it", self.runner_id)
            self._process.kill()
        returncode = await self._process.wait()
        self._report_exit(returncode)

    def _observe(self, report: RunnerReport | TokenFrame) -> None:
        if isinstance(report, RunnerStatusReport):
            self.status = report.status

    def _report_exit(self, returncode: int) -> None:
        self._exited = True
        how = describe_exit(returncode)
        log.log(
            logging.INFO if returncode == 0 else logging.WARNING,
            "runner %s %s",
            self.runner_id,
            how,
        )
        clean = returncode == 0 and isinstance(self.status, RunnerShutdown)
        already_told = isinstance(self.status, RunnerFailed)
        if not (clean or already_told or self._stop_requested):
            self.status = RunnerFailed(error=f"runner {how}")
            status = RunnerStatusReport(status=self.status)
            self._reports.put_nowait(RunnerReported(self.runner_id, status))
        self._reports.put_nowait(RunnerExited(self.runner_id, returncode, how))
