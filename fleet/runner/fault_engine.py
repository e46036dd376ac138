"""A fault-injection engine: a TEST DOUBLE for plumbing tests, never evidence that a model works.

The runner picks it only for a model card whose family is "fault". It loads nothing and makes
numbered tokens (" t0", " t1", ...), so the runner's state machine, the pipe, the supervisor
and the worker can be driven without mlx. Knobs written anywhere in the task's text steer it:

    tokens:N        make N tokens, then finish "stop" (capped by max_tokens: then "length")
    delay_ms:X      each step takes X ms (the slowest running task sets the pace)
    tokens_per_s:R  the task makes at most R tokens a second (a measurement knob: it paces
                    the plumbing at a chosen rate; without it, tokens come as fast as steps)
    crash_after:K   after K tokens the next step raises, as a broken engine would
    first_token_ms:X  the first token comes X ms after admission at the earliest (a slow
                    prefill: the task is running and has sent nothing)
    reject:REASON   admit refuses the task with that ErrorReason (e.g. reject:unsupported)

Load-time knobs come from the environment the worker gives the runner:
FLEET_FAULT_LOAD_MS (loading takes that long, spread over the card's layers) and
FLEET_FAULT_LOAD_FAIL=1 (loading raises). It prints to stdout while loading, on purpose, as
mlx and mflux may: the runner must keep stray prints off its frame pipe.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleet.errors import TaskRejected
from fleet.runner.engine import Admission, EngineConfig, EngineEvent, Progress, Token
from fleet.wire.cluster import ModelCard
from fleet.wire.events import ErrorReason, TaskFinished, Usage, failed
from fleet.wire.tasks import TextGeneration

FAULT_FAMILY = "fault"
_KNOB = re.compile(
    r"\b(tokens|tokens_per_s|delay_ms|crash_after|reject|first_token_ms):([A-Za-z0-9_]+)")


def fault_card(model_id: str = "fault-llm", n_layers: int = 2) -> ModelCard:
    """A model card that selects this engine."""
    return ModelCard(
        id=model_id,
        name="Fault injection (test double)",
        tasks=["text_generation"],
        family=FAULT_FAMILY,
        source="built-in",
        n_layers=n_layers,
    )


@dataclass(frozen=True)
class Knobs:
    tokens: int = 8
    delay_ms: int = 0
    crash_after: int | None = None
    reject: ErrorReason | None = None
    tokens_per_s: int | None = None
    first_token_ms: int = 0


def parse_knobs(text: str) -> Knobs:
    found = dict(_KNOB.findall(text))
    return Knobs(
        tokens=int(found.get("tokens", Knobs.tokens)),
        delay_ms=int(found.get("delay_ms", Knobs.delay_ms)),
        crash_after=int(found["crash_after"]) if "crash_after" in found else None,
        reject=ErrorReason(found["reject"]) if "reject" in found else None,
        tokens_per_s=int(found["tokens_per_s"]) if "tokens_per_s" in found else None,
        first_token_ms=int(found.get("first_token_ms", Knobs.first_token_ms)),
    )


def task_text(task: TextGeneration) -> str:
    if task.prompt is not None:
        return task.prompt
    parts: list[str] = []
    for message in task.messages or []:
        if isinstance(message.content, str):
            parts.append(message.content)
        elif message.content:
            parts.extend(getattr(part, "text", "") for part in message.content)
    return " ".join(parts)


@dataclass
class _Run:
    task: TextGeneration
    knobs: Knobs
    prompt_tokens: int
    produced: int = 0
    next_at: float = 0.0  # a paced task (tokens_per_s) makes its next token at this time
    first_at: float = 0.0  # no token before this time (first_token_ms: a slow prefill)


class FaultEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._sleep = sleep or time.sleep
        # An idle paced wait ends when a command arrives (`wake`): a real engine's step is
        # short, so a task sent to it is admitted at the next one, not after the slowest
        # paced task's next token (issue 25: a chat waited up to a 20 ms period beside a job).
        self._woken = threading.Event()
        self._idle = sleep or self._idle_unless_woken
        self._runs: dict[str, _Run] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def load(self, progress: Progress) -> None:
        print(f"fault engine: loading {self._config.card.id} (a stray print, on purpose)")
        layers = max(self._config.card.n_layers, 1)
        load_s = int(os.environ.get("FLEET_FAULT_LOAD_MS", "0")) / 1000
        for layer in range(1, layers + 1):
            self._sleep(load_s / layers)
            progress(layer, layers)
        if os.environ.get("FLEET_FAULT_LOAD_FAIL") == "1":
            raise RuntimeError("fault injected: loading failed")

    def warm_up(self) -> None:
        pass

    def admit(self, admission: Admission) -> None:
        task = admission.task
        if not isinstance(task, TextGeneration):
            raise TaskRejected(ErrorReason.UNSUPPORTED, "the fault engine only makes tokens")
        text = task_text(task)
        knobs = parse_knobs(text)
        if knobs.reject is not None:
            raise TaskRejected(knobs.reject, f"fault injected: rejected as {knobs.reject}")
        if len(self._runs) >= self._config.slots:
            raise TaskRejected(ErrorReason.QUEUE_FULL, f"all {self._config.slots} slots busy")
        # A continued task goes on from the token after those its earlier attempts streamed.
        self._runs[task.task_id] = _Run(
            task, knobs, prompt_tokens=len(text.split()), produced=len(admission.generated),
            first_at=self._clock() + knobs.first_token_ms / 1000,
        )

    def step(self) -> list[EngineEvent]:
        if not self._runs:
            return []
        if delay_ms := max(run.knobs.delay_ms for run in self._runs.values()):
            self._sleep(delay_ms / 1000)  # (a sleep of 0 is a syscall a step, at full rate)
        self._wait_for_paced()
        with self._lock:
            cancelled = self._cancelled & self._runs.keys()
            self._cancelled -= cancelled
        events: list[EngineEvent] = []
        for task_id, run in list(self._runs.items()):
            if task_id in cancelled:
                del self._runs[task_id]
                events.append(failed(task_id, self._clock(), ErrorReason.CANCELLED, "cancelled"))
                continue
            if run.produced >= min(run.knobs.tokens, run.task.max_tokens):
                # A continuation whose earlier attempts streamed every token (the worker was
                # lost before their terminal): it ends without one more, as the text engine's
                # `_ended_before` does. A fault test saw token 720 of a 720-token task.
                del self._runs[task_id]
                events.append(self._completed(run))
                continue
            if run.knobs.crash_after is not None and run.produced >= run.knobs.crash_after:
                raise RuntimeError(f"fault injected: crash after {run.produced} tokens")
            if not self._due(run):
                continue
            index = run.produced
            events.append(Token(task_id, self._clock(), index, index, f" t{index}"))
            run.produced += 1
            if run.produced >= min(run.knobs.tokens, run.task.max_tokens):
                del self._runs[task_id]
                events.append(self._completed(run))
        return events

    def _due(self, run: _Run) -> bool:
        """Whether a task makes a token in this step; a paced one books its next one."""
        if self._clock() < run.first_at:
            return False
        rate = run.knobs.tokens_per_s
        if not rate:
            return True
        now = self._clock()
        if now < run.next_at:
            return False
        # On its cadence, unless a whole period late: a late step does not bunch tokens up.
        period = 1 / rate
        run.next_at = run.next_at + period if now - run.next_at < period else now + period
        return True

    def _wait_for_paced(self) -> None:
        """When every running task is paced and none is due, idle until the first is (the
        step would otherwise spin, and a real engine's step takes time too), or until a
        command arrives (`wake`)."""
        if any(not run.knobs.tokens_per_s for run in self._runs.values()):
            return
        wait = min(run.next_at for run in self._runs.values()) - self._clock()
        if wait > 0:
            self._idle(wait)

    def _idle_unless_woken(self, seconds: float) -> None:
        self._woken.wait(seconds)
        self._woken.clear()  # a wake that came while no wait was open ends one wait early

    def wake(self) -> None:
        self._woken.set()

    def _completed(self, run: _Run) -> TaskFinished:
        stopped = run.knobs.tokens <= run.task.max_tokens
        return TaskFinished(
            task_id=run.task.task_id,
            at=self._clock(),
            status="completed",
            finish_reason="stop" if stopped else "length",
            usage=Usage(
                prompt_tokens=run.prompt_tokens,
                completion_tokens=run.produced,
                total_tokens=run.prompt_tokens + run.produced,
            ),
        )

    def cancel(self, task_id: str) -> None:
        with self._lock:
            self._cancelled.add(task_id)

    @property
    def active(self) -> int:
        return len(self._runs)

    def close(self) -> None:
        self._runs.clear()
