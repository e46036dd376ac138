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
one type check and one dict lookup. They are made as records directly (`made`), not as SDK
spans: made whole after the fact, they need none of the SDK's machinery, which cost about
half the runner's CPU a task at 64 slots of max_tokens-1 tasks (issue 23). They follow the
SDK's default sampling (the parent's flag, read from SubmitTask's traceparent without a
Context) and exist only where the SDK is on. A SpanBatch holds them in runs of one trace
each, which the worker publishes as written (fleet.wire.framing.span_batch_of).
"""

from __future__ import annotations

import queue
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

from fleet.runner.engine import Token
from fleet.runner.image_steps import StepTiming
from fleet.runner.vision_cache import EncodeTiming
from fleet.telemetry import operation_of, parent_of
from fleet.trace.records import SPANS_PER_MESSAGE, SpanRecord, made, record_of
from fleet.wire.events import ImageChunk, TaskFinished, TokenChunk
from fleet.wire.framing import span_batch_of
from fleet.wire.pipe import (
    RunnerCommand,
    RunnerReport,
    RunnerSpec,
    RunnerStatusReport,
    SubmitTask,
)
from fleet.wire.runners import RunnerFailed, RunnerLoading, RunnerStatus
from fleet.wire.tasks import Embeddings, ImageEdits, ImageGeneration, Task, TextGeneration


def _ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)


def _span_id() -> str:
    return format(random.getrandbits(64) or 1, "016x")  # the SDK's id generator, never 0


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
    parent: tuple[str, str, bool] | None  # its trace id, span id and sampled flag; None: none
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
        started = self._startup.get_span_context()
        self._startup_link = [{"trace_id": format(started.trace_id, "032x"),
                               "span_id": format(started.span_id, "016x")}]
        # Where task spans are made as records: the SDK's service name, None when it is off.
        self._service: str | None = None
        if isinstance(self._tracer, SdkTracer):
            self._service = str(self._tracer.resource.attributes.get("service.name", "unknown"))
        self._phase: Span | None = None  # load or warm-up, while it runs
        self._tasks: dict[str, _TaskTimes] = {}
        self.deferred = False  # spans wait for `send` (see `observing`)
        self._steps: queue.SimpleQueue[StepTiming] = queue.SimpleQueue()

    def on_step(self, timing: StepTiming) -> None:
        """The image engine's step hook (its model thread): queued for the main thread, for
        a task that has spans here (an unsampled task's steps would wait for no one)."""
        if timing.task_id in self._tasks:
            self._steps.put(timing)

    def on_encode(self, timing: EncodeTiming) -> None:
        """The vision engine's hook, on the main thread (inside admission)."""
        if times := self._tasks.get(timing.task_id):
            times.encode = timing

    def on_command(self, command: RunnerCommand) -> None:
        if not isinstance(command, SubmitTask) or command.task.task_id in self._tasks:
            return
        parent = parent_of(command.traceparent, command.tracestate)
        if self._service is None or (parent is not None and not parent[2]):
            return  # no spans to make: the SDK is off, or the task's trace is not sampled
        self._tasks[command.task.task_id] = _TaskTimes(
            task=command.task, parent=parent, submitted_ns=time.time_ns())

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
        if times is None or (service := self._service) is None:
            return  # `on_command` left out the unsampled (the SDK's default sampler)
        if times.parent is None:  # a root of its own, as the SDK would start it
            trace_id, parent_id = format(random.getrandbits(128) or 1, "032x"), None
        else:
            trace_id, parent_id, _ = times.parent
        task = times.task
        end_ns = max(_ns(finished.at), times.submitted_ns)
        attributes = request_attributes(task) | result_attributes(finished)
        if self._rank is not None:
            attributes["fleet.rank"] = self._rank
        if times.first_token_ns is not None:  # as the prefill span shows it
            ttft_s = max(0, times.first_token_ns - times.submitted_ns) / 1e9
            attributes["gen_ai.server.time_to_first_token"] = ttft_s
        events = [{"name": "image", "time_ns": at, "attributes": image}
                  for at, image in times.images]
        error = (finished.message or "") if finished.status in ("failed", "expired") else None
        generation = made(
            f"{operation_of(task)} {task.model}", trace_id=trace_id,
            span_id=_span_id(), parent_id=parent_id, service=service,
            start_ns=times.submitted_ns, end_ns=end_ns, attributes=attributes, events=events,
            links=self._startup_link, error=error,
        )
        records = [generation]
        if isinstance(task, TextGeneration):
            self._text_phases(records, times, finished, end_ns)
        else:
            self._diffusion_steps(records, finished.task_id)
        self._buffer.add(trace_id, records)

    def _child(self, generation: SpanRecord, name: str, start_ns: int, end_ns: int,
               attributes: dict[str, Any]) -> SpanRecord:
        """A child of the generation span: `made`'s record, built here without its checks
        (a task's two or three children are made per task; their attributes are never None)."""
        record: SpanRecord = {
            "trace_id": generation["trace_id"], "span_id": _span_id(), "name": name,
            "kind": "internal", "service": generation["service"], "start_ns": start_ns,
            "end_ns": end_ns, "parent_id": generation["span_id"],
        }
        if attributes:
            record["attributes"] = attributes
        return record

    def _text_phases(
        self, records: list[SpanRecord], times: _TaskTimes, finished: TaskFinished, end_ns: int
    ) -> None:
        """prefill, encode images (a vision task), decode (once a token came): after the
        generation span, first in `records`."""
        generation = records[0]
        first = times.first_token_ns
        prefill_end = end_ns if first is None else min(max(first, times.submitted_ns), end_ns)
        usage, stats = finished.usage, finished.stats
        prefill: dict[str, Any] = {}
        if usage:
            prefill["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        if stats and stats.prompt_tokens_per_s:
            prefill["fleet.prompt_tokens_per_s"] = stats.prompt_tokens_per_s
        records.append(self._child(generation, "prefill", times.submitted_ns, prefill_end,
                                   prefill))
        if (encode := times.encode) is not None:
            records.append(self._child(
                generation, "encode images", _ns(encode.started), _ns(encode.ended),
                {"fleet.vision.images": encode.images,
                 "fleet.vision.cached_images": encode.cached}))
        if first is None:
            return
        decode: dict[str, Any] = {}
        if usage:
            decode["gen_ai.usage.output_tokens"] = usage.completion_tokens
        if stats and stats.tokens_per_s:
            decode["fleet.tokens_per_s"] = stats.tokens_per_s
        records.append(self._child(generation, "decode", prefill_end, end_ns, decode))

    def _diffusion_steps(self, records: list[SpanRecord], task_id: str) -> None:
        generation = records[0]
        while not self._steps.empty():
            step = self._steps.get_nowait()
            if step.task_id != task_id:
                continue  # from a task that has no spans here (refused before it ran)
            records.append(self._child(
                generation, f"diffusion step {step.step + 1}/{step.total}",
                _ns(step.started), _ns(step.ended),
                {"fleet.image.index": step.image_index, "fleet.step": step.step}))

    def observing(
        self, emit: Callable[[RunnerReport | Token], None],
    ) -> Callable[[RunnerReport | Token], None]:
        """`emit`, then these spans see the report, then the spans it finished follow it;
        while `deferred`, they wait for `send` instead (the runner's loop sends once a pass,
        so a step that ends 64 tasks sends one SpanBatch, not 64)."""

        def emit_observed(report: RunnerReport | Token) -> None:
            emit(report)
            self.on_report(report)
            if not self.deferred:
                self.send(emit)

        return emit_observed

    def send(self, emit: Callable[[RunnerReport | Token], None]) -> None:
        """The spans finished since the last send, as one SpanBatch (none when none)."""
        if self._buffer.runs:
            emit(span_batch_of(self._buffer.take()))


class SpanBuffer(SpanProcessor):
    """Finished spans as records, in runs of one trace (a task's spans, an SDK span), until
    the runner's loop sends them to the worker over the pipe (the runner has no NATS). Spans
    end on the main thread only: no lock."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, list[SpanRecord]]] = []

    def add(self, trace_id: str, records: list[SpanRecord]) -> None:
        """Records of one trace; in runs that fit one `fleet.traces` message each."""
        for start in range(0, len(records), SPANS_PER_MESSAGE):
            self.runs.append((trace_id, records[start : start + SPANS_PER_MESSAGE]))

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            record = record_of(span)
            self.add(record["trace_id"], [record])

    def take(self) -> list[tuple[str, list[SpanRecord]]]:
        runs, self.runs = self.runs, []
        return runs
