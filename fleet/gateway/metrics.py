"""What the gateway's /metrics reports, as OpenTelemetry instruments (fleet/meters.py renders
them as Prometheus text).

- The task timings both sides share (TaskTimings), timed here from the HTTP request.
- `fleet.gateway.errors` by error.type: failed requests and tasks.
- HTTP server metrics (http.server.request.duration, http.server.active_requests) come from
  OpenTelemetry's ASGI instrumentation on this same meter provider (gateway/tracing.py).
- Gauges read at scrape time: requests waiting on task events, and per model the queue
  figures of FLEET_TASKS and FLEET_DEAD, which the /metrics route reads from JetStream just
  before rendering (an observable gauge's callback cannot await).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation

from fleet.meters import MODEL, Meters, TaskTimings, task_attributes
from fleet.wire.events import ImageChunk, OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import Task

if TYPE_CHECKING:
    from fleet.gateway.backend import ModelQueue

# (instrument name, ModelQueue field, description): messaging has no convention for a
# queue's depth, so these keep Fleet's names.
QUEUE_GAUGES = (
    ("fleet.queue.depth", "queued", "Tasks in FLEET_TASKS not yet acknowledged, per model"),
    ("fleet.tasks.in_flight", "in_flight", "Tasks handed to a worker and not acknowledged yet"),
    ("fleet.tasks.redelivered", "redelivered",
     "Tasks in flight that were handed out more than once (a worker died or stalled)"),
    ("fleet.tasks.dead_lettered", "dead_lettered",
     "Tasks in FLEET_DEAD after their last delivery"),
)


class GatewayMetrics:
    """Everything /metrics reports that the gateway itself observes or reads at a scrape."""

    def __init__(self) -> None:
        self.meters = Meters("fleet-gateway")
        meter = self.meters.meter("fleet.gateway")
        self.timings = TaskTimings(meter)
        self._errors = meter.create_counter(
            "fleet.gateway.errors", unit="{error}",
            description="Failed requests and tasks by error.type",
        )
        # The latest scrape's readings; an OTLP export between scrapes reports these too.
        self._queues: Mapping[str, ModelQueue] = {}
        self._waiting = 0
        meter.create_observable_gauge(
            "fleet.gateway.waiting_requests", [self._observe_waiting], unit="{request}",
            description="Requests waiting on task events (chats in flight, event streams)",
        )
        for name, field, description in QUEUE_GAUGES:
            meter.create_observable_gauge(
                name, [self._queue_reader(field)], unit="{task}", description=description
            )

    def error(self, reason: str) -> None:
        self._errors.add(1, {"error.type": reason})

    def render(self, queues: Mapping[str, ModelQueue], waiting: int = 0) -> bytes:
        """`waiting`: requests now waiting on task events (their limit answers 429); a total,
        so an open /metrics names no tenant."""
        self._queues, self._waiting = queues, waiting
        return self.meters.exposition()

    def _observe_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._waiting)

    def _queue_reader(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for model, queue in self._queues.items():
                yield Observation(getattr(queue, field), {MODEL: model})

        return observe


class TaskObserver:
    """Times one task's events as the gateway relays them (monotonic seconds in, no clock here)."""

    def __init__(self, metrics: GatewayMetrics, task: Task, started: float) -> None:
        self.timings = metrics.timings
        self.attributes = task_attributes(task)
        self.started = started
        self.accepted = False
        self.first_output: float | None = None
        self.last_token: float | None = None
        self.token_count = 0

    def see(self, event: OutputEvent, now: float) -> None:
        match event:
            case TaskAccepted() if not self.accepted:  # a redelivery is accepted again
                self.accepted = True
                self.timings.queue_wait.record(now - self.started, self.attributes)
            case TokenChunk() | ImageChunk() if self.first_output is None:
                self.first_output = now
                self.timings.time_to_first_token.record(now - self.started, self.attributes)
        if isinstance(event, TokenChunk):
            self.token_count += 1
            self.last_token = now
        if isinstance(event, TaskFinished):
            self.finish(event, now)

    def finish(self, finished: TaskFinished, now: float) -> None:
        if self.token_count > 1 and self.first_output is not None and self.last_token is not None:
            mean = (self.last_token - self.first_output) / (self.token_count - 1)
            self.timings.time_per_output_token.record(mean, self.attributes)
        self.timings.finished(self.attributes, now - self.started, finished)
