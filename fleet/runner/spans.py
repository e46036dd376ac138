"""The runner's spans, made from the messages it receives and sends: no engine code traces.

- `start runner <model>`: a trace of its own, from this process's start to Ready, with children
  `load <model>` (Loading → Loaded) and `warm_up <model>` (WarmingUp → Ready). Warm-up is no
  task's work, so each task's generation span links to it instead of containing it.
- Per task, a child of the context SubmitTask carries (the worker's process span): the
  generation span `<operation> <model>` with the GenAI attributes; under it, for text,
  `prefill` (submit → first token) and `decode` (first token → finished), and for a vision
  task `encode images` (its images made features, from the vision cache or the encoder,
  inside prefill's time); for images one
  `diffusion step` span per StepTiming the engine's step hook reported.

A task's spans are all made after its TaskFinished is written, from the times recorded on the
way, and leave in one SpanBatch: the task's end waits on none of it, and per token the cost is
one type check and one dict lookup.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import Link, Span, Status, StatusCode, TracerProvider

from fleet.runner.engine import Token
from fleet.runner.image_steps import StepTiming
from fleet.runner.vision_cache import EncodeTiming
from fleet.telemetry import context_of, operation_of
from fleet.trace.records import SpanRecord, record_of
from fleet.wire.events import ImageChunk, TaskFinished, TokenChunk
from fleet.wire.pipe import (
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    SpanBatch,
    SubmitTask,
)
from fleet.wire.runners import RunnerFailed, RunnerLoading, RunnerStatus
from fleet.wire.tasks import Embeddings, ImageEdits, ImageGeneration, Task, TextGeneration


def _ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)


def request_attributes(task: Task) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation_of(task),
        "gen_ai.request.model": task.model,
        "fleet.task.id": task.task_id,
    }
    if isinstance(task, TextGeneration):
        attributes |= {
            "gen_ai.request.max_tokens": task.max_tokens,
            "gen_ai.request.temperature": task.temperature,
            "gen_ai.request.top_p": task.top_p,
        }
        if task.session:  # OpenTelemetry's name for the conversation a request belongs to
            attributes["gen_ai.conversation.id"] = task.session
    elif isinstance(task, ImageGeneration | ImageEdits):
        attributes |= {"fleet.image.size": task.size, "fleet.image.count": task.n}
        if task.steps is not None:
            attributes["fleet.image.steps"] = task.steps
    elif isinstance(task, Embeddings):
        attributes["fleet.embeddings.inputs"] = len(task.input)
    if not isinstance(task, Embeddings) and task.seed is not None:
        attributes["gen_ai.request.seed"] = task.seed
    return attributes


def result_attributes(finished: TaskFinished) -> dict[str, Any]:
    attributes: dict[str, Any] = {"fleet.task.status": finished.status}
    if finished.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (finished.finish_reason,)
    if finished.reason and finished.status != "completed":
        attributes["error.type"] = finished.reason.value
    if usage := finished.usage:
        attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
    if stats := finished.stats:
        if stats.tokens_per_s:
            attributes["gen_ai.server.time_per_output_token"] = 1.0 / stats.tokens_per_s
        if stats.queue_wait_s is not None:
            attributes["fleet.queue_wait_s"] = stats.queue_wait_s
        if stats.batched_with is not None:
            attributes["fleet.batched_with"] = stats.batched_with
    return attributes


@dataclass
class _TaskTimes:
    task: Task
    parent: Context
    submitted_ns: int
    first_token_ns: int | None = None
    images: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (at, attributes)
    encode: EncodeTiming | None = None  # a vision task's images made features


class RunnerSpans:
    def __init__(
        self, spec: RunnerSpec, buffer: SpanBuffer, provider: TracerProvider | None = None
    ) -> None:
        """`buffer`: where `provider` (the process's, unless a test brings its own) puts
        finished spans, for `observing` to send."""
        self._tracer = trace.get_tracer("fleet.runner", tracer_provider=provider)
        self._buffer = buffer
        self._model = spec.card.id
        self._rank = spec.group.rank if spec.group is not None else None  # a sharded instance
        self._startup: Span | None = self._tracer.start_span(
            f"start runner {self._model}",
            context=Context(),  # a root: no task is waiting on this runner yet
            attributes={
                "gen_ai.request.model": self._model,
                "fleet.runner.id": spec.runner_id,
                "fleet.instance.id": spec.instance_id,
                "fleet.node.id": spec.node_id,
            },
        )
        self._startup_link = Link(self._startup.get_span_context())
        self._phase: Span | None = None  # load or warm-up, while it runs
        self._tasks: dict[str, _TaskTimes] = {}
        self._steps: queue.SimpleQueue[StepTiming] = queue.SimpleQueue()

    def on_step(self, timing: StepTiming) -> None:
        """The image engine's step hook (its model thread): queued for the main thread."""
        self._steps.put(timing)

    def on_encode(self, timing: EncodeTiming) -> None:
        """The vision engine's hook, on the main thread (inside admission)."""
        if times := self._tasks.get(timing.task_id):
            times.encode = timing

    def on_command(self, command: RunnerCommand) -> None:
        if isinstance(command, SubmitTask) and command.task.task_id not in self._tasks:
            self._tasks[command.task.task_id] = _TaskTimes(
                task=command.task,
                parent=context_of(command.traceparent, command.tracestate),
                submitted_ns=time.time_ns(),
            )

    def on_report(self, report: RunnerReport | Token) -> None:
        if isinstance(report, Token | TokenChunk):  # first: the only reports made per token
            times = self._tasks.get(report.task_id)
            if times is not None and times.first_token_ns is None:
                times.first_token_ns = _ns(report.at)
        elif isinstance(report, TaskFinished):
            self._finish(report)
        elif isinstance(report, ImageChunk):
            self._image(report)
        elif isinstance(report, RunnerStatusReport) and self._startup is not None:
            self._on_status(self._startup, report.status)

    # ---- the runner's start ------------------------------------------------------------

    def _on_status(self, startup: Span, status: RunnerStatus) -> None:
        if isinstance(status, RunnerFailed):
            for span in (self._phase, startup):
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, status.error))
                    span.end()
            self._phase = self._startup = None
            return
        inside = trace.set_span_in_context(startup)
        if isinstance(status, RunnerLoading):
            if self._phase is None:
                self._phase = self._tracer.start_span(f"load {self._model}", context=inside)
            self._phase.set_attribute("fleet.layers_total", status.layers_total)
            return
        if self._phase is not None and status.state in ("loaded", "ready"):
            self._phase.end()
            self._phase = None
        if status.state == "warming_up":
            self._phase = self._tracer.start_span(f"warm_up {self._model}", context=inside)
        elif status.state == "ready":
            startup.end()
            self._startup = None

    # ---- one task ----------------------------------------------------------------------

    def _image(self, chunk: ImageChunk) -> None:
        if times := self._tasks.get(chunk.task_id):
            attributes: dict[str, Any] = {"fleet.image.index": chunk.image_index}
            if chunk.partial_index is not None:
                attributes["fleet.image.partial_index"] = chunk.partial_index
            times.images.append((_ns(chunk.at), attributes))

    def _finish(self, finished: TaskFinished) -> None:
        times = self._tasks.pop(finished.task_id, None)
        if times is None:
            return
        end_ns = max(_ns(finished.at), times.submitted_ns)
        generation = self._tracer.start_span(
            f"{operation_of(times.task)} {times.task.model}",
            context=times.parent,
            attributes=request_attributes(times.task) | result_attributes(finished),
            links=[self._startup_link],
            start_time=times.submitted_ns,
        )
        if self._rank is not None:
            generation.set_attribute("fleet.rank", self._rank)
        if times.first_token_ns is not None:  # as the prefill span shows it
            ttft_s = max(0, times.first_token_ns - times.submitted_ns) / 1e9
            generation.set_attribute("gen_ai.server.time_to_first_token", ttft_s)
        for at, attributes in times.images:
            generation.add_event("image", attributes, at)
        if finished.status in ("failed", "expired"):
            generation.set_status(Status(StatusCode.ERROR, finished.message))
        inside = trace.set_span_in_context(generation)
        if isinstance(times.task, TextGeneration):
            self._text_phases(times, finished, inside, end_ns)
        else:
            self._diffusion_steps(finished.task_id, inside)
        generation.end(end_time=end_ns)

    def _text_phases(
        self, times: _TaskTimes, finished: TaskFinished, inside: Context, end_ns: int
    ) -> None:
        first = times.first_token_ns
        prefill_end = end_ns if first is None else min(max(first, times.submitted_ns), end_ns)
        prefill = self._tracer.start_span("prefill", context=inside, start_time=times.submitted_ns)
        if finished.usage:
            prefill.set_attribute("gen_ai.usage.input_tokens", finished.usage.prompt_tokens)
        if finished.stats and finished.stats.prompt_tokens_per_s:
            prefill.set_attribute("fleet.prompt_tokens_per_s", finished.stats.prompt_tokens_per_s)
        prefill.end(end_time=prefill_end)
        if (encode := times.encode) is not None:
            span = self._tracer.start_span(
                "encode images", context=inside, start_time=_ns(encode.started),
                attributes={"fleet.vision.images": encode.images,
                            "fleet.vision.cached_images": encode.cached})
            span.end(end_time=_ns(encode.ended))
        if first is None:
            return
        decode = self._tracer.start_span("decode", context=inside, start_time=prefill_end)
        if finished.usage:
            decode.set_attribute("gen_ai.usage.output_tokens", finished.usage.completion_tokens)
        if finished.stats and finished.stats.tokens_per_s:
            decode.set_attribute("fleet.tokens_per_s", finished.stats.tokens_per_s)
        decode.end(end_time=end_ns)

    def _diffusion_steps(self, task_id: str, inside: Context) -> None:
        while not self._steps.empty():
            step = self._steps.get_nowait()
            if step.task_id != task_id:
                continue  # from a task that has no spans here (refused before it ran)
            span = self._tracer.start_span(
                f"diffusion step {step.step + 1}/{step.total}",
                context=inside,
                attributes={"fleet.image.index": step.image_index, "fleet.step": step.step},
                start_time=_ns(step.started),
            )
            span.end(end_time=_ns(step.ended))

    def observing(
        self, emit: Callable[[RunnerReport | Token], None],
    ) -> Callable[[RunnerReport | Token], None]:
        """`emit`, then these spans see the report, then the spans it finished follow it."""

        def emit_observed(report: RunnerReport | Token) -> None:
            emit(report)
            self.on_report(report)
            if self._buffer.records:
                emit(SpanBatch(spans=self._buffer.take()))

        return emit_observed


class SpanBuffer(SpanProcessor):
    """Finished spans as records until the runner's loop sends them to the worker over the
    pipe (the runner has no NATS). Spans end on the main thread only: no lock."""

    def __init__(self) -> None:
        self.records: list[SpanRecord] = []

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.records.append(record_of(span))

    def take(self) -> list[SpanRecord]:
        records, self.records = self.records, []
        return records
