"""The runner subprocess: `python -m fleet.runner.main SPEC_JSON` (or `fleet runner --spec`).

Two threads. The pipe reader turns stdin frames into commands on a queue, and applies a
CancelTask to the engine at once (the engine's only thread-safe call) so that a cancel lands
within one decode step even while the main thread is inside `step()`. The main thread owns the
engine and the state machine: drain commands, handle them, step while tasks are in flight.

stdout carries frames and nothing else: its descriptor is duplicated for the frames and fd 1 is
pointed at stderr, because mlx, mflux and their dependencies may print. Logs go to stderr.
Closed stdin means the worker is gone: shut down and exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fleet import gc_policy
from fleet.models.blas import set_openblas_threads
from fleet.runner.coalesce import TokenCoalescer, Written
from fleet.runner.company import StepClock, window_s
from fleet.runner.engine import Engine, EngineConfig, GroupLost, Wakeable
from fleet.runner.fault_engine import FAULT_FAMILY, FaultEngine
from fleet.runner.image_steps import StepHook
from fleet.runner.machine import RunnerMachine
from fleet.runner.spans import RunnerSpans, SpanBuffer
from fleet.runner.vision_cache import EncodeHook
from fleet.telemetry import setup
from fleet.wire.codec import DecodeError, decode_model, encode
from fleet.wire.framing import (
    FrameError,
    FrameReader,
    FrameWriter,
    decode_command,
    span_batch_body,
)
from fleet.wire.pipe import (
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    Shutdown,
    SpanBatch,
)
from fleet.wire.ring import RING_LOST_EXIT
from fleet.wire.runners import RunnerFailed, RunnerIdle, RunnerReady, RunnerRunning
from fleet.wire.tasks import CancelTask

log = logging.getLogger("fleet.runner")


@dataclass(frozen=True)
class PipeBroken:
    """stdin carried something that is not a command: the worker and runner disagree."""

    error: str


Inbox = queue.Queue[RunnerCommand | PipeBroken]


def engine_config(spec: RunnerSpec) -> EngineConfig:
    return EngineConfig(
        card=spec.card,
        model_path=Path(spec.model_path),
        slots=spec.slots,
        images_dir=Path(spec.images_dir),
        node_id=spec.node_id,
        runner_id=spec.runner_id,
    )


def make_engine(
    spec: RunnerSpec, on_step: StepHook | None = None,
    last_words: Callable[[str], None] = lambda reason: None,
    on_encode: EncodeHook | None = None,
) -> Engine:
    """The engine for the card; imported lazily so the fault engine never imports mlx.
    `last_words(reason)` is a sharded runner's Failed report when its ring never forms."""
    config = engine_config(spec)
    if spec.card.family == FAULT_FAMILY:
        return FaultEngine(config)
    _use_openblas()
    if spec.card.is_vision and spec.group is None:
        from fleet.runner.vision import VisionEngine

        return VisionEngine(config, on_encode=on_encode)
    if spec.card.is_embedding and spec.group is None:
        from fleet.runner.embed import EmbeddingEngine

        return EmbeddingEngine(config)
    if spec.group is not None:
        if spec.card.is_image or spec.card.is_embedding or spec.card.is_vision:
            raise ValueError("image, embedding and vision models are not sharded")
        from fleet.runner.lockstep import LockstepEngine
        from fleet.runner.text import TextEngine

        return LockstepEngine(TextEngine(config), spec.group, last_words)
    if spec.card.is_image:
        from fleet.runner.image import ImageEngine

        return ImageEngine(config, on_step=on_step)
    from fleet.runner.text import TextEngine

    return TextEngine(config)


def _use_openblas() -> None:
    # Must run before mlx is first imported, hence the late import.
    from fleet.models.blas import enable_openblas

    loaded = enable_openblas()
    log.info("BLAS: %s", loaded or "mlx's own (no OpenBLAS found)")


# A pass's reports leave in one write (the loop flushes once a pass): at 64 slots of
# max_tokens-1 tasks a pass is ~64 token events, terminals and a SpanBatch of ~192 records,
# ~100 KB, which an 8 KB buffer and a 64 KB pipe cut into a dozen writes, each a wake-up of
# the worker's reader and many a block on the full pipe (py-spy, 2026-12-05: the pipe writes
# ~30 % of the runner's busy samples). A bigger pipe is asked for, not needed: where the
# kernel says no, writes block as before.
OUT_BUFFER_BYTES = 1 << 20


def _claim_stdout() -> BinaryIO:
    """A private handle on the real stdout for frames; fd 1 then leads to stderr."""
    sys.stdout.flush()
    fd = os.dup(1)
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux
        with contextlib.suppress(OSError):  # not a pipe, or past the user's pipe limit
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, OUT_BUFFER_BYTES)
    frames = os.fdopen(fd, "wb", buffering=OUT_BUFFER_BYTES)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return frames


def _read_commands(reader: FrameReader, engine: Engine, inbox: Inbox) -> None:
    # Asked once: an isinstance against a runtime-checkable Protocol walks its members each
    # time (~5 % of the fault runner's busy samples under batches, py-spy 2026-12-05).
    wake = engine.wake if isinstance(engine, Wakeable) else None
    try:
        while (body := reader.read()) is not None:
            command = decode_command(body)
            if isinstance(command, CancelTask):
                engine.cancel(command.task_id)
            inbox.put(command)
            if wake is not None:
                wake()
    except (FrameError, DecodeError) as exc:
        inbox.put(PipeBroken(f"unreadable command from the worker: {exc}"))
        return
    log.info("stdin closed: the worker is gone or done, shutting down")
    inbox.put(Shutdown())


def _next_batch(inbox: Inbox, wait: bool) -> list[RunnerCommand | PipeBroken]:
    """Everything queued; when `wait`, block for the first item (nothing else to do)."""
    batch: list[RunnerCommand | PipeBroken] = []
    if wait:
        batch.append(inbox.get())
    while True:
        try:
            batch.append(inbox.get_nowait())
        except queue.Empty:
            return batch


def serve(
    machine: RunnerMachine,
    inbox: Inbox,
    observe: Callable[[RunnerCommand], None] = lambda command: None,
    stepped: Callable[[float], None] = lambda seconds: None,
    passed: Callable[[], None] = lambda: None,
) -> int:
    """The main thread's loop until the machine is done; returns the process exit code.
    `observe` sees each command just before the machine does (spans start there);
    `stepped` gets each engine step's duration (the token coalescer's clock); `passed` ends
    each pass (a batch of commands, a step): what it reported leaves together then. A task
    that reaches the engine idle waits a moment for company first (fleet.runner.company)."""

    def take(item: RunnerCommand | PipeBroken) -> None:
        if isinstance(item, PipeBroken):
            machine.fail(item.error)
        else:
            observe(item)
            machine.handle(item)

    share = machine.company_share
    clock = StepClock()
    loaded = False
    while not machine.done:
        was_idle = not machine.busy
        for item in _next_batch(inbox, wait=was_idle):
            take(item)
            if machine.done:
                break
        if not loaded and isinstance(machine.state, RunnerReady):
            # The model is loaded: out of every later collection. Before the pass's flush
            # sends Ready, so the full collection (~65 ms) is not the first tasks' wait.
            loaded = True
            gc_policy.freeze_startup()
        passed()
        gathering = was_idle and machine.busy and not machine.done
        if gathering and (window := window_s(clock.typical_s, share)) > 0:
            _gather(inbox, take, machine, window)
            passed()
        if machine.busy and not machine.done:
            began = time.perf_counter()
            machine.step()
            took = time.perf_counter() - began
            clock.add(took)
            stepped(took)
            passed()
    return machine.exit_code


def _gather(
    inbox: Inbox, take: Callable[[RunnerCommand | PipeBroken], None], machine: RunnerMachine,
    window: float,
) -> None:
    """Commands arriving within `window` of a task reaching the idle engine are taken before
    its first step (fleet.runner.company). The inbox is asked at least once, with no wait
    once the window has passed: a window shorter than a preemption still takes what came."""
    deadline = time.perf_counter() + window
    while not machine.done:
        try:
            take(inbox.get(timeout=max(0.0, deadline - time.perf_counter())))
        except queue.Empty:
            return


def serve_follower(
    machine: RunnerMachine,
    inbox: Inbox,
    follow: Callable[[], None],
    observe: Callable[[RunnerCommand], None] = lambda command: None,
) -> int:
    """A rank > 0 of a sharded instance: its worker takes it to ready, then it follows rank 0
    over the ring (`follow`) until rank 0 stops the group, and shuts down."""
    while not machine.done:
        for item in _next_batch(inbox, wait=True):
            if isinstance(item, PipeBroken):
                machine.fail(item.error)
            else:
                observe(item)
                machine.handle(item)
            if machine.done:
                break
        if isinstance(machine.state, RunnerReady):
            follow()
            machine.handle(Shutdown())
    return machine.exit_code


def _written_at_once(report: RunnerReport) -> bool:
    """Whether a report leaves before its pass ends: a status that comes from inside a long
    pass (load progress, warming up, a failure). Running's count and Ready come at a step's
    end or among a batch of commands, right before the pass's flush: flushed at once they were
    a second write to the pipe a pass (and a second wake-up of the worker's reader)."""
    return isinstance(report, RunnerStatusReport) and not isinstance(
        report.status, RunnerRunning | RunnerReady)


class _Reporter:
    """Writes reports as frames; once the worker stops reading, later reports are dropped.

    While `deferred` (the main loop's passes, each ended by `flush`), a task's reports stay in
    the pipe's buffer until the pass ends: a step that ends 64 tasks is one write to the pipe
    (and one wake-up of the worker's reader), not one a terminal. A status report from inside
    a long pass (a model's load progress) is written at once (`_written_at_once`)."""

    def __init__(self, writer: FrameWriter) -> None:
        self._writer = writer
        self._open = True
        self.deferred = False

    def __call__(self, report: Written) -> None:
        if not self._open:
            return
        try:
            if isinstance(report, bytes):  # a token event, encoded; the coalescer flushes
                self._writer.write_body(report, flush=False)
            else:
                flush = not self.deferred or _written_at_once(report)
                body = span_batch_body(report) if isinstance(report, SpanBatch) else encode(report)
                self._writer.write_body(body, flush=flush)
        except (BrokenPipeError, ConnectionResetError):
            self._closed()

    def flush(self) -> None:
        if not self._open:
            return
        try:
            self._writer.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._closed()

    def _closed(self) -> None:
        log.warning("the worker stopped reading reports")
        self._open = False


def _traced(spec: RunnerSpec) -> RunnerSpans:
    """Spans go to the worker over the pipe; the worker exports them (OTLP, NATS)."""
    resource: dict[str, str | int] = {
        "service.instance.id": spec.runner_id, "fleet.node.id": spec.node_id,
    }
    if spec.group is not None:
        resource["fleet.rank"] = spec.group.rank
    buffer = SpanBuffer()
    if telemetry := setup("fleet-runner", resource=resource, otlp=False):
        telemetry.add_processor(buffer)
    return RunnerSpans(spec, buffer)


def run_runner(spec_json: str, frames: BinaryIO | None = None) -> int:
    """`frames`: stdout already claimed (a standby claims it before its imports)."""
    frames = frames or _claim_stdout()
    # The worker decides when a runner stops; a Ctrl-C meant for the terminal's foreground
    # process group must not kill runners mid-task behind the worker's back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        spec = decode_model(RunnerSpec, spec_json.encode())
    except DecodeError as exc:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        log.error("invalid runner spec: %s", exc)
        return 2
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s runner {spec.runner_id} %(levelname)s %(name)s: %(message)s",
        force=True,  # the runner's lines share the worker's stderr: they must say whose they are
    )
    spans = _traced(spec)
    writer = FrameWriter(frames)
    reporter = _Reporter(writer)
    coalescer = TokenCoalescer(reporter, flush=reporter.flush)
    coalescer.start_flusher()
    report = spans.observing(coalescer)

    def passed() -> None:  # a pass of the main loop ended: its spans, then all in one write
        spans.send(coalescer)
        reporter.flush()

    def last_words(reason: str) -> None:
        # From the ring's watchdog (a forked child): straight to the pipe, nothing else.
        writer.write(RunnerStatusReport(status=RunnerFailed(error=reason)))

    try:
        engine = make_engine(spec, on_step=spans.on_step, last_words=last_words,
                             on_encode=spans.on_encode)
    except Exception as exc:
        log.exception("no engine for %s", spec.card.id)
        report(RunnerStatusReport(status=RunnerFailed(error=f"no engine: {exc}")))
        passed()
        return 1
    connect = getattr(engine, "connect", lambda: None)
    machine = RunnerMachine(spec, engine, emit=report, connect=connect)
    inbox: Inbox = queue.Queue()
    # Unbuffered: a buffered stdin holds a lock that a reader thread still blocked in read()
    # would own at interpreter exit, and Python aborts on that.
    with open(0, "rb", buffering=0, closefd=False) as stdin:
        threading.Thread(
            target=_read_commands,
            args=(FrameReader(stdin), engine, inbox),
            name="pipe-reader",
            daemon=True,
        ).start()
        try:
            if spec.group is not None and spec.group.rank > 0:
                # This rank's events are rank 0's: only the spans they make go to the worker.
                traced = spans.observing(
                    lambda item: report(item) if isinstance(item, SpanBatch) else None
                )

                def follow() -> None:
                    engine.follow(spans.on_command, traced)

                code = serve_follower(machine, inbox, follow, observe=spans.on_command)
            else:
                reporter.deferred = spans.deferred = True  # sent once a pass: `passed`
                code = serve(machine, inbox, observe=spans.on_command,
                             stepped=coalescer.step_ended, passed=passed)
        except GroupLost as exc:
            # No terminal for the tasks in flight: the worker sees a crash and ends or
            # continues them, and restarts the group.
            log.error("%s: exiting as crashed", exc)
            passed()
            coalescer.close()  # the tokens made before it: a continuation goes on after them
            return RING_LOST_EXIT
        passed()
        coalescer.close()
    log.info("exiting with %d (%s)", code, machine.state.state)
    return code


def exit_runner(code: int) -> None:
    """Leave without interpreter teardown once everything is reported and flushed.

    Tearing down after mflux ran sometimes aborts (SIGABRT) in native destructors, which the
    worker would read as a crash of a runner that in fact shut down cleanly.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


STANDBY = "--standby"


def run_standby() -> int:
    """A runner started before it has a job (fleet.worker.standby): do a text runner's slow
    imports (mlx-lm, transformers) now, then wait on stdin for one frame, `{"spec", "env"}`,
    and run as `run_runner` would. A closed stdin before it: the worker dropped it."""
    frames = _claim_stdout()  # before the imports: nothing they print may reach the frames
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _use_openblas()
    importlib.import_module("fleet.runner.lockstep")  # the slow imports (and fleet.runner.text)
    FrameWriter(frames).write(RunnerStatusReport(status=RunnerIdle()))  # warm: the worker knows

    with open(0, "rb", buffering=0, closefd=False) as stdin:  # unbuffered: reads one frame
        body = FrameReader(stdin).read()
    if body is None:
        return 0
    job = json.loads(body)
    os.environ.update(job["env"])
    # OpenBLAS read its thread count when the standby loaded it; the job's may differ.
    set_openblas_threads(int(job["env"].get("OPENBLAS_NUM_THREADS") or 0))
    return run_runner(job["spec"], frames)


if __name__ == "__main__":
    gc_policy.serving_thresholds()
    exit_runner(run_standby() if sys.argv[1] == STANDBY else run_runner(sys.argv[1]))
