"""Coalescing a task's tokens: one pipe frame (and so one NATS message, one SSE frame) per
short window instead of per token.

At a GPU's rates (thousands of tokens a second per node) Fleet's cost is per message, not per
token: decoding a frame, publishing it with a confirmation, relaying it to HTTP. So the runner
holds a task's tokens briefly and sends them as one TokenChunk (`token_ids`, joined text):

- a task's first token is never held (time to first token is untouched);
- a task's tokens leave at most WINDOW_S after the oldest was made, or once MAX_TOKENS wait;
- any other event of the task (a tool call, an error, its terminal) sends its held tokens
  first, so the task's events keep their order and a terminal never waits;
- after an engine step, tokens stay held only when the next step, expected to take as long as
  this one (with STEP_MARGIN for its jitter), would still end inside the window: a model that
  steps slower than the window (a CPU model, ~10-60 ms a step) sends every token at once, as
  before. The step's time is the
  engine's: time spent writing reports (blocked on a full pipe while the worker catches up)
  does not count, so a worker that falls behind gets fuller events, not more of them.

A flusher thread enforces the window when a step runs long (a prefill joining the batch).
`flush_due` is the rule, a pure function; `TokenCoalescer` applies it to the runner's reports.

The coalescer writes each token event as its encoded bytes (`token_event`: orjson of a plain
dict, the codec's exact bytes), never a TokenChunk: at full rate the runner's per-event model
and its encode were its largest cost after the engine's own tokens (py-spy, 2026-12-05). Token
events are written unflushed and flushed together (`flush`) when the step that made them has
been reported, when the flusher has sent, and after any other report: one write to the pipe a
step, not one an event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.runner.engine import Token
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.wire.pipe import RunnerReport
from fleet.wire.token_frames import token_event

log = logging.getLogger(__name__)

WINDOW_S = 0.005
MAX_TOKENS = 16
# A step about as long as the window would end right at its edge, where the flusher sends the
# held token anyway: a token held for it then waits the whole window and, when the step runs
# a little long, joins nothing. Steps vary, so a held token must expect its company well
# inside the window. Measured without it (2026-12-04, quiet, one stream at 200 tok/s, steps
# of ~4.9 ms): 6.1 ms p50 added per token, every event of one token.
STEP_MARGIN = 1.5


def flush_due(
    *, tokens: int, first: bool, ended: bool, held_s: float, next_step_s: float,
    window_s: float = WINDOW_S, max_tokens: int = MAX_TOKENS,
) -> bool:
    """Whether a task's held tokens must leave now.

    tokens: how many are held; first: they include the task's first token; ended: another
    event of the task follows them (or it ended); held_s: age of the oldest; next_step_s: how
    long until more tokens could join (0 while a step is still producing)."""
    if first or ended or tokens >= max_tokens:
        return True
    return held_s + STEP_MARGIN * next_step_s >= window_s


def coalescable(event: TokenChunk) -> bool:
    """Tokens with logprobs travel one per event (their numbers are per token)."""
    return event.logprob is None and not event.top_logprobs and event.token_ids is None


@dataclass
class _Held:
    """A task's held tokens: the first one's index and time, then every id and text."""

    since: float
    index: int
    at: float
    ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


# What the coalescer writes: a report, or a token event already encoded (the codec's bytes).
Written = RunnerReport | bytes


class TokenCoalescer:
    """Wraps the runner's report writer; thread-safe (the main thread reports, the flusher
    thread enforces the window)."""

    def __init__(
        self, write: Callable[[Written], None], *, flush: Callable[[], None] = lambda: None,
        window_s: float = WINDOW_S, max_tokens: int = MAX_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`write` may buffer token events (bytes) until `flush`; a report it writes goes
        out with everything written before it."""
        self._write = write
        self._flush = flush
        self._unflushed = False  # token events written since the last flush
        self._window_s = window_s
        self._max_tokens = max_tokens
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._started: set[str] = set()  # tasks whose first token went out
        # The hot paths take the plain lock itself (a C-level `with`); the condition, over the
        # same lock, is the flusher's to wait on.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._closed = False
        # The flusher waits untimed only while nothing is held; a hold wakes it then alone.
        # In a timed wait it wakes by itself by the oldest's deadline (a later hold's is later
        # still): a notify per step cost a thread switch and a contended lock a step (py-spy,
        # 2026-12-05: notify 5 % and the lock's wait 14 % of the runner's busy samples).
        self._flusher_idle = False
        self._reporting_s = 0.0  # time the main thread spent in here since the last step

    def __call__(self, report: RunnerReport | Token) -> None:
        began = time.perf_counter()
        try:
            self._report(report)
        finally:
            self._reporting_s += time.perf_counter() - began

    def _report(self, report: RunnerReport | Token) -> None:
        with self._mutex:
            if type(report) is Token or (isinstance(report, TokenChunk) and coalescable(report)):
                self._hold(report)
                return
            task_id = getattr(report, "task_id", None)
            if task_id is not None and task_id in self._held:
                self._send(task_id)
            if isinstance(report, TaskFinished):
                self._started.discard(report.task_id)
            self._write(report)
            self._unflushed = False

    def _hold(self, chunk: Token | TokenChunk) -> None:
        held = self._held.get(chunk.task_id)
        if held is None and chunk.task_id not in self._started:
            # A first token leaves at once (flush_due's `first`): holding it first would wake
            # the flusher for nothing, a thread switch a task (py-spy, 2026-12-05, max_tokens-1
            # tasks: notify ~10 % of the runner's busy samples).
            self._started.add(chunk.task_id)
            self._write(token_event(chunk.task_id, chunk.at, chunk.index, [chunk.token_id],
                                    chunk.text))
            self._unflushed = True
            return
        now = self._clock()
        if held is None:
            held = self._held[chunk.task_id] = _Held(since=now, index=chunk.index, at=chunk.at)
            if self._flusher_idle:
                self._flusher_idle = False
                self._lock.notify()
        held.ids.append(chunk.token_id)
        held.texts.append(chunk.text)
        if flush_due(tokens=len(held.ids), first=chunk.task_id not in self._started,
                     ended=False, held_s=now - held.since, next_step_s=0.0,
                     window_s=self._window_s, max_tokens=self._max_tokens):
            self._send(chunk.task_id)

    def step_ended(self, step_s: float) -> None:
        """After an engine step of `step_s` seconds (reporting included): send what the
        next one, as long as this one's engine time, would make too old."""
        engine_s, self._reporting_s = max(0.0, step_s - self._reporting_s), 0.0
        with self._mutex:
            self._send_due(engine_s)
            self._flush_written()

    def _send_due(self, next_step_s: float) -> None:
        now = self._clock()
        for task_id, held in list(self._held.items()):
            if flush_due(tokens=len(held.ids), first=False, ended=False,
                         held_s=now - held.since, next_step_s=next_step_s,
                         window_s=self._window_s, max_tokens=self._max_tokens):
                self._send(task_id)

    def _send(self, task_id: str) -> None:
        held = self._held.pop(task_id)
        self._started.add(task_id)
        self._write(token_event(task_id, held.at, held.index, held.ids, "".join(held.texts)))
        self._unflushed = True

    def _flush_written(self) -> None:
        if self._unflushed:
            self._unflushed = False
            self._flush()

    def flush(self) -> None:
        with self._mutex:
            for task_id in list(self._held):
                self._send(task_id)
            self._flush_written()

    def run_flusher(self) -> None:
        """The flusher thread's loop: no token waits past the window, however long a step."""
        try:
            self._flush_on_time()
        except Exception:
            log.exception("the token flusher failed; held tokens now leave after each step")

    def _flush_on_time(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._held:
                    self._flusher_idle = True
                    self._lock.wait()
                    continue
                oldest = min(held.since for held in self._held.values())
                wait = oldest + self._window_s - self._clock()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                self._send_due(0.0)
                self._flush_written()

    def start_flusher(self) -> threading.Thread:
        thread = threading.Thread(target=self.run_flusher, name="token-flusher", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Send everything held and stop the flusher."""
        with self._lock:
            for task_id in list(self._held):
                self._send(task_id)
            self._flush_written()
            self._closed = True
            self._lock.notify()
