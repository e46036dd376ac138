"""OpenTelemetry for every Fleet process: one `setup` each, and the trace context carried in
NATS headers and runner frames.

Where finished spans go:
- OTLP over HTTP/protobuf when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  is set; the exporter reads the other OTEL_EXPORTER_OTLP_* variables itself. Metrics are
  not set up here: each component (gateway, worker) has a meter provider of its own that
  serves /metrics and pushes over OTLP the same way (fleet/meters.py).
- `fleet.traces.<trace_id>` on NATS once a process that holds a connection calls
  `export_to_nats`, so `fleet trace` needs no collector.
- A runner adds its pipe instead: it has no NATS, and its worker re-exports its spans.

The worker's per-task spans (its `process` spans, their children, the `send` span of each
publish) are not SDK spans but live spans (fleet/trace/live.py, `start_span`): records from the
start, exported to the same places (NATS, OTLP) at their end, at a fraction of the SDK's cost.
Span processors added with `add_processor` see SDK spans only.

OTEL_SDK_DISABLED=true skips all of it; the API's no-op tracer then costs a function call, and
`start_span` returns the invalid span at once.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleet.trace.live import LiveSpan, LiveSpans, Within
from fleet.trace.records import SpanRecord, readable_of
from fleet.wire.pipe import TraceSpans
from fleet.wire.tasks import Embeddings, ImageEdits, Task, TextGeneration

if TYPE_CHECKING:  # the runner imports this module and has no NATS
    from nats.aio.client import Client

    from fleet.trace.nats_export import NatsSpanProcessor

log = logging.getLogger(__name__)

OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
# Subjects named per task are high-cardinality: span names use their template instead.
_PER_TASK_PREFIXES = ("fleet.out.", "fleet.cancel.")


class Telemetry:
    """The process's tracer provider and the exporters Fleet added to it."""

    def __init__(self, provider: TracerProvider, otlp: BatchSpanProcessor | None) -> None:
        self.provider = provider
        self.otlp = otlp
        self.nats: NatsSpanProcessor | None = None
        service = str(provider.resource.attributes.get("service.name", "unknown"))
        self.live = LiveSpans(service, provider.sampler, self._opened, self._ended)

    def _opened(self, trace_id: str) -> None:
        if self.nats is not None:
            self.nats.opened(trace_id)

    def _ended(self, record: SpanRecord, local_root: bool) -> None:
        """A live span ended: exported as the SDK's span processors would have."""
        if self.otlp is not None:
            self.otlp.on_end(readable_of(record, self.provider.resource))
        if self.nats is not None:
            self.nats.ended(record, local_root)

    def add_processor(self, processor: SpanProcessor) -> None:
        self.provider.add_span_processor(processor)

    def export_to_nats(self, client: Callable[[], Client | None]) -> None:
        """Publish finished spans over `client()` (None while not connected: spans dropped).
        Call from the event loop; a process keeps the first connection it is given."""
        from fleet.trace.nats_export import NatsSpanProcessor

        if self.nats is None:
            self.nats = NatsSpanProcessor(client)
            self.provider.add_span_processor(self.nats)

    def export_runner_spans(self, runs: list[TraceSpans]) -> None:
        """Spans a runner finished, as it wrote them, exported as if they had ended here: to
        NATS as they are, never parsed; read only where OTLP needs SDK spans of them."""
        if self.otlp is not None:
            for run in runs:
                for record in _records_in(run):
                    self.otlp.on_end(readable_of(record))
        if self.nats is not None:
            self.nats.add(runs)

    async def flush(self) -> None:
        """Before a connection closes: what is buffered for NATS goes out now."""
        if self.nats is not None:
            await self.nats.flush()


_installed: Telemetry | None = None


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def setup(
    service_name: str, *, resource: Mapping[str, str] | None = None, otlp: bool = True
) -> Telemetry | None:
    """Install the SDK for this process (once: a second call returns the first install).
    `otlp=False` for a process whose spans another one exports (a runner)."""
    global _installed
    if _installed is not None:
        return _installed
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    described = Resource.create({"service.name": service_name, **(resource or {})})
    provider = TracerProvider(resource=described)
    otlp_processor = None
    if otlp and otlp_configured("TRACES"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp_processor = BatchSpanProcessor(OTLPSpanExporter())
        provider.add_span_processor(otlp_processor)
        log.info("exporting spans over OTLP/HTTP")
    trace.set_tracer_provider(provider)
    _installed = Telemetry(provider, otlp_processor)
    return _installed


def otlp_configured(signal: str) -> bool:
    """An OTLP endpoint is set for all signals, or for this one (TRACES, METRICS)."""
    specific = f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
    return bool(os.environ.get(OTLP_ENDPOINT) or os.environ.get(specific))


def export_to_nats(client: Callable[[], Client | None]) -> None:
    if _installed is not None:
        _installed.export_to_nats(client)


def export_runner_spans(runs: list[TraceSpans]) -> None:
    if _installed is not None:
        _installed.export_runner_spans(runs)


def _records_in(run: TraceSpans) -> list[SpanRecord]:
    """A runner's run of records, read (for OTLP); none where it is not the JSON it should be."""
    try:
        records = orjson.loads(b"[" + run.body + b"]")
    except orjson.JSONDecodeError as exc:
        log.warning("a runner's spans of trace %s are not JSON, not exported: %s",
                    run.trace_id, exc)
        return []
    return [record for record in records if isinstance(record, dict)]


async def flush() -> None:
    if _installed is not None:
        await _installed.flush()


def start_span(
    name: str, kind: SpanKind, context: Context | None, attributes: dict[str, Any]
) -> Span:
    """A live span (fleet/trace/live.py) under `context`'s span (None: the current one); the
    invalid span where the SDK is off. Not made current: the caller does that if it must."""
    if _installed is None:
        return INVALID_SPAN
    return _installed.live.start(name, kind, context, attributes)


# ---- context in and out of headers ---------------------------------------------------------


# The worker publishes every token of a task under one Context object; formatting the same
# traceparent each time would cost more than the rest of a token's publish. Contexts are
# immutable, so the headers of one are computed once. Strong references keep ids unique.
_INJECTED_CACHE_SIZE = 256
_injected: dict[int, tuple[Context, dict[str, str]]] = {}


def inject_headers(headers: MutableMapping[str, str]) -> None:
    current = otel_context.get_current()
    cached = _injected.get(id(current))
    if cached is None or cached[0] is not current:
        carrier = _live_carrier(current)
        if carrier is None:
            carrier = {}
            propagate.inject(carrier, context=current)
        if len(_injected) >= _INJECTED_CACHE_SIZE:
            _injected.clear()
        cached = _injected[id(current)] = (current, carrier)
    headers.update(cached[1])


# The propagators OTEL_PROPAGATORS names by default: W3C trace context and baggage. Under
# them alone (checked again whenever the global propagator is replaced), a context without
# baggage travels as W3C trace context only, which is read and written here without the
# composite propagator's calls (issue 23: ~1 % of a worker's CPU each way).
_DEFAULT_PROPAGATORS = (TraceContextTextMapPropagator, W3CBaggagePropagator)
_W3C = TraceContextTextMapPropagator()
_checked: tuple[object, bool] = (None, False)


def _default_propagators() -> bool:
    global _checked
    textmap = propagate.get_global_textmap()
    if _checked[0] is not textmap:
        kinds = tuple(type(p) for p in getattr(textmap, "_propagators", ()))
        _checked = (textmap, kinds == _DEFAULT_PROPAGATORS)
    return _checked[1]


def _live_carrier(context: Context) -> dict[str, str] | None:
    """A live span's headers (its `carrier`) where the propagators would write just them."""
    span = trace.get_current_span(context)
    if not isinstance(span, LiveSpan) or baggage.get_all(context) or not _default_propagators():
        return None
    return span.carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    if not headers:
        return Context()  # what the propagators make of no headers
    if "baggage" not in headers and _default_propagators():
        return _W3C.extract(headers)
    return propagate.extract(dict(headers))


def context_of(traceparent: str | None, tracestate: str | None) -> Context:
    """The context a runner frame carries (SubmitTask), as if read from message headers."""
    carrier = {"traceparent": traceparent or ""}
    if tracestate:
        carrier["tracestate"] = tracestate
    return propagate.extract(carrier)


# A W3C traceparent of version 00 as the worker writes one (`carried`), ids in their groups.
_PARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def parent_of(traceparent: str | None, tracestate: str | None) -> tuple[str, str, bool] | None:
    """The parent a runner frame names, as `context_of` reads it: (trace id, span id, sampled),
    None where it names none valid. A traceparent as the worker writes it, under the default
    propagators, is read here without the propagator's context and carrier (a runner reads
    one a task: ~4 % of its CPU at rate, issue 23)."""
    found = _PARENT.fullmatch(traceparent or "")
    if (found is not None and _default_propagators()
            and found.group(1) != "0" * 32 and found.group(2) != "0" * 16):
        return found.group(1), found.group(2), bool(int(found.group(3), 16) & 1)
    parent = trace.get_current_span(context_of(traceparent, tracestate)).get_span_context()
    if not parent.is_valid:
        return None
    sampled = parent.trace_flags.sampled
    return format(parent.trace_id, "032x"), format(parent.span_id, "016x"), sampled


def trace_id_of(traceparent: str | None) -> str | None:
    """The W3C trace id inside a traceparent header, or None when absent or malformed."""
    found = _TRACEPARENT.match(traceparent or "")
    if found is None or found.group(1) == "0" * 32:
        return None
    return found.group(1)


def carried(span: Span) -> tuple[str | None, str | None]:
    """(traceparent, tracestate) naming `span` as the parent, for a runner frame: W3C trace
    context, what the propagator writes, formatted here without its context and carrier calls."""
    if isinstance(span, LiveSpan):
        carrier = span.carrier
        return carrier["traceparent"], carrier.get("tracestate")
    context = span.get_span_context()
    if not context.is_valid:
        return None, None
    traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    return traceparent, context.trace_state.to_header() or None


# ---- GenAI names -----------------------------------------------------------------------------


def operation_of(task: Task) -> str:
    """The GenAI operation name (custom ones for images, which the conventions lack), for the
    runner's spans and everyone's metrics."""
    if isinstance(task, TextGeneration):
        return "chat" if task.messages is not None else "text_completion"
    if isinstance(task, Embeddings):
        return "embeddings"
    return "image_edit" if isinstance(task, ImageEdits) else "image_generation"


# ---- the producer span of a published message ------------------------------------------


def destination_template(subject: str) -> str:
    for prefix in _PER_TASK_PREFIXES:
        if subject.startswith(prefix):
            return prefix + "{task_id}"
    return subject


def send_span(subject: str, msg_id: str | None, body_size: int) -> Within:
    """`send <subject>` (PRODUCER), current while the message is published, so its headers
    name it as the parent of whatever processes the message. A live span (`start_span`): the
    SDK's cost a publish was ~7 % of a worker's CPU at rate (issue 23). None at all where the
    SDK is off, and one not sampled is not made current: the sampling that follows the
    parent's flag (the default) sees the same flag on the context around it."""
    if _installed is None:
        return Within(INVALID_SPAN, current=False)
    template = destination_template(subject)
    attributes: dict[str, Any] = {
        "messaging.system": "nats",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": subject,
        "messaging.message.body.size": body_size,
    }
    if template != subject:
        attributes["messaging.destination.template"] = template
    if msg_id:
        attributes["messaging.message.id"] = msg_id
    span = _installed.live.start(f"send {template}", SpanKind.PRODUCER, None, attributes)
    return Within(span, current=isinstance(span, LiveSpan) or not _installed.live.parent_based)
