"""The worker's spans: one `process fleet.tasks.<model>` (CONSUMER) per task message it takes,
a child of the context the message carries, from the fetch to the ack, nak or term.

While the loop works on a task its process span is current (`active`), so whatever the worker
publishes for the task carries it in `traceparent`, and the runner's spans hang under it
(`dispatched` gives the context for SubmitTask). `child` wraps the worker's own effects for a
task: fetching its input images, putting its output images. A task's terminal event also
feeds its metrics (TaskMetrics), split by the task's model and operation.

They are live spans (fleet.telemetry.start_span, fleet/trace/live.py), not SDK spans: the
same spans where the same exporters see them, at a fraction of the SDK's cost a task (issue 23).
"""

from __future__ import annotations

import contextlib
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from fleet.bus.connect import MSG_ID
from fleet.meters import task_attributes
from fleet.telemetry import carried, extract_context, start_span
from fleet.trace.live import Within
from fleet.wire import subjects
from fleet.wire.events import TaskFinished
from fleet.wire.tasks import Task
from fleet.worker.task_metrics import TaskMetrics


class _Current:
    """Makes a context current: what `trace.use_span` does, minus its exception recording,
    which a loop that dies on an exception anyway does not need, at ~1/4 of its cost per
    token."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self._token: object = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._context)

    def __exit__(self, *exc: object) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]


class TaskSpans:
    def __init__(self) -> None:
        self._open: dict[str, Span] = {}  # task id -> its process span, until settled
        self._contexts: dict[str, Context] = {}  # task id -> a context with that span current
        self._attributes: dict[str, dict[str, str]] = {}  # task id -> its metrics' attributes
        self.metrics = TaskMetrics(held=lambda: len(self._open))

    def received(self, msg: Msg) -> Span:
        """Start the process span of a message just fetched (before it is even decoded)."""
        model = subjects.model_of_task_subject(msg.subject)
        attributes: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": msg.subject,
            "messaging.consumer.group.name": subjects.durable(model),
            "messaging.message.body.size": len(msg.data),
        }
        if msg.metadata is not None:
            attributes["fleet.delivery"] = msg.metadata.num_delivered
        if msg.headers and (msg_id := msg.headers.get(MSG_ID)):
            attributes["messaging.message.id"] = msg_id
        return start_span(f"process {msg.subject}", SpanKind.CONSUMER,
                          extract_context(msg.headers), attributes)

    def queued(self, task: Task, span: Span) -> None:
        task_id = task.task_id
        span.set_attribute("messaging.message.id", task_id)
        self._open[task_id] = span
        self._contexts[task_id] = trace.set_span_in_context(span)
        self._attributes[task_id] = task_attributes(task)

    def dispatched(self, task_id: str, runner_id: str) -> tuple[str | None, str | None]:
        """(traceparent, tracestate) for SubmitTask: the runner's spans join under ours."""
        span = self._open.get(task_id)
        if span is None:
            return None, None
        span.add_event("dispatch", {"fleet.runner.id": runner_id})
        return carried(span)

    def current(self, span: Span) -> contextlib.AbstractContextManager[None]:
        return _Current(trace.set_span_in_context(span))

    def active(self, task_id: str | None) -> contextlib.AbstractContextManager[None]:
        """The task's process span as the current one (nothing when it has none)."""
        context = self._contexts.get(task_id) if task_id else None
        return contextlib.nullcontext() if context is None else _Current(context)

    def child(
        self, task_id: str, name: str, attributes: dict[str, Any]
    ) -> contextlib.AbstractContextManager[object]:
        """A span of the task's, current in the block (nothing when the task has none)."""
        context = self._contexts.get(task_id)
        if context is None:
            return contextlib.nullcontext()
        return Within(start_span(name, SpanKind.INTERNAL, context, attributes), context)

    def finished(self, event: TaskFinished) -> None:
        """The task's outcome, as the worker publishes it (the runner's or its own)."""
        if attributes := self._attributes.get(event.task_id):
            self.metrics.finished(attributes, event)
        if span := self._open.get(event.task_id):
            span.set_attribute("fleet.task.status", event.status)
            if event.status in ("failed", "expired"):
                if event.reason:
                    span.set_attribute("error.type", event.reason.value)
                span.set_status(Status(StatusCode.ERROR, event.message))

    def settled(
        self, task_id: str | None, verb: str, span: Span | None = None, reason: str | None = None
    ) -> None:
        """End the process span with the JetStream verb that settled the message; `span` and
        `reason` for a message settled at intake, before it was queued."""
        if task_id and span is None:
            span = self._open.pop(task_id, None)
            self._contexts.pop(task_id, None)
            self._attributes.pop(task_id, None)
        if span is None:
            return
        if task_id:
            span.set_attribute("messaging.message.id", task_id)
        if reason:
            span.set_attribute("fleet.settled_reason", reason)
        span.add_event(verb)
        span.end()
