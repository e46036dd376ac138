"""What the gateway tells an operator: /metrics instruments, HTTP server spans and the access
log.

/metrics reports OpenTelemetry instruments (fleet/meters.py renders them as Prometheus text):

- The task timings both sides share (TaskTimings), timed here from the HTTP request.
- `fleet.gateway.errors` by error.type: failed requests and tasks.
- HTTP server metrics (http.server.request.duration, http.server.active_requests) come from
  OpenTelemetry's ASGI instrumentation on this same meter provider (`http_spans`).
- Gauges read at scrape time: requests waiting on task events, and per model the queue
  figures of FLEET_TASKS and FLEET_DEAD, which the /metrics route reads from JetStream just
  before rendering (an observable gauge's callback cannot await).

HTTP server spans and metrics come from OpenTelemetry's ASGI instrumentation; the span
(`<METHOD> <route>`, SERVER) is the root of the request's trace unless the client sent a
`traceparent`, whose trace it then joins. It is current while the app runs, so the task the
request publishes is its child (`send fleet.tasks.<model>`), and it ends when the response's
last byte is sent. The same middleware records http.server.request.duration and
http.server.active_requests on the gateway's meter provider. Health checks, metric scrapes and
the dashboard's static files are left out of both: they would be a trace each, every few
seconds."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.util.http import ExcludeList
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
            self.token_count += event.count
            self.last_token = now
        if isinstance(event, TaskFinished):
            self.finish(event, now)

    def finish(self, finished: TaskFinished, now: float) -> None:
        if self.token_count > 1 and self.first_output is not None and self.last_token is not None:
            mean = (self.last_token - self.first_output) / (self.token_count - 1)
            self.timings.time_per_output_token.record(mean, self.attributes)
        self.timings.finished(self.attributes, now - self.started, finished)


# Probes, scrapes and the dashboard's static files: no span, and their access lines at debug.
_UNTRACED = r"/(?:healthz|health|metrics|ui/static/.*|docs/static/.*)"


UNTRACED_PATH = re.compile(_UNTRACED)


# The instrumentation matches against the whole URL (scheme, host, path).
UNTRACED_URLS = ExcludeList([rf"^[a-z]+://[^/]*{_UNTRACED}$"])


# One line per request: `<client> "<METHOD> <path>" <status> <ms> ms task=<id>` (health checks
# and scrapes at debug). The task id comes from the response's x-fleet-task-id header.
access_log = logging.getLogger("fleet.gateway.access")


def http_spans(
    app: ASGIApp, routes: Sequence[BaseRoute], meter_provider: MeterProvider
) -> ASGIApp:
    """`app` inside the ASGI instrumentation, with spans named by route template."""
    # The instrumentation writes the stable HTTP conventions (http.request.method,
    # http.response.status_code, seconds) only when opted in; it reads this once.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")

    def span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
        method = scope.get("method", "HTTP")
        route = route_of(routes, scope)
        return (f"{method} {route}", {"http.route": route}) if route else (method, {})

    return OpenTelemetryMiddleware(
        app,
        excluded_urls=UNTRACED_URLS,
        default_span_details=span_details,
        meter_provider=meter_provider,
        # A span per receive and send would be one per streamed token.
        exclude_spans=["receive", "send"],
    )


def route_of(routes: Sequence[BaseRoute], scope: Scope) -> str | None:
    """The template of the route that will serve `scope`, matched as Starlette's router
    matches (the first full match, else the first that matches all but the method: its 405),
    so the span is named, and its duration recorded, by template from the start: a path with
    a task id or an image hash in it would be a metric series of its own."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path_format", None)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path_format", None)
    return partial


def access_line(scope: Scope, status: int, elapsed_s: float, task_id: str) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{who} "{scope["method"]} {scope["path"]}" {status or "-"} {elapsed_s * 1000:.1f} ms'
    return line + (f" task={task_id}" if task_id else "")


def header_of(message: Message, name: bytes) -> str:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


class TraceOfItsOwn:
    """Each request starts with no trace context, so its span is a root (or joins the client's
    `traceparent`). uvicorn starts a pipelined request's task from inside the previous
    request's task, whose span is current there: without this, every request after it on the
    connection joined that request's trace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = otel_context.attach(Context())
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


class AccessLog:
    """The access-log line of each request, written when the app is done with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_code = 0
        task_id = ""
        started = time.perf_counter()

        async def send_noting_status(message: Message) -> None:
            nonlocal status_code, task_id
            if message["type"] == "http.response.start":
                status_code = message["status"]
                task_id = header_of(message, b"x-fleet-task-id")
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            level = logging.DEBUG if UNTRACED_PATH.fullmatch(scope["path"]) else logging.INFO
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s", access_line(
                    scope, status_code, time.perf_counter() - started, task_id))
