"""A finished span as a plain JSON object: what runners send over their pipe and what
`fleet.traces.<trace_id>` carries, one message `{"spans": [record, ...]}` per trace and flush
(a task's spans together: fleet/trace/held.py).

    {"trace_id": 32 hex, "span_id": 16 hex, "parent_id": 16 hex (absent for a root),
     "name": str, "kind": "server" | "client" | "producer" | "consumer" | "internal",
     "service": str, "start_ns": int, "end_ns": int (unix nanoseconds),
     "attributes": {...}, "events": [{"name", "time_ns", "attributes"}],
     "links": [{"trace_id", "span_id"}], "status": "error", "status_message": str}

Empty fields are left out. Pure conversions only: nothing here exports or reads a clock.

A runner's records reach its worker as JSON and stay so (TraceSpans, fleet/wire/pipe.py): the
worker holds and publishes them beside its own records without parsing them. `Spans` is
either, one record or a run of them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from fleet.wire.pipe import TraceSpans

SpanRecord = dict[str, Any]
Spans = SpanRecord | TraceSpans  # one record of this process's, or a runner's run of them

SPANS_PER_MESSAGE = 200  # records in one `fleet.traces.<trace_id>` message, at most

_KIND_NAMES = {kind: kind.name.lower() for kind in SpanKind}
_KINDS = {name: kind for kind, name in _KIND_NAMES.items()}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def record_of(span: ReadableSpan) -> SpanRecord:
    context = span.context
    assert context is not None, "a finished SDK span always has a context"
    record: SpanRecord = {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "name": span.name,
        "kind": _KIND_NAMES[span.kind],
        "service": span.resource.attributes.get("service.name", "unknown"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
    }
    if span.parent is not None:
        record["parent_id"] = format(span.parent.span_id, "016x")
    if span.attributes:
        record["attributes"] = dict(span.attributes)
    if span.events:
        record["events"] = [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ]
    if span.links:
        record["links"] = [
            {
                "trace_id": format(link.context.trace_id, "032x"),
                "span_id": format(link.context.span_id, "016x"),
            }
            for link in span.links
        ]
    if span.status.status_code is StatusCode.ERROR:
        record["status"] = "error"
        if span.status.description:
            record["status_message"] = span.status.description
    return record


def trace_of(spans: Spans) -> str:
    return spans.trace_id if isinstance(spans, TraceSpans) else spans["trace_id"]


def count_of(spans: Spans) -> int:
    return spans.count if isinstance(spans, TraceSpans) else 1


def made(
    name: str, *, trace_id: str, span_id: str, parent_id: str | None, service: str,
    start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None, links: list[dict[str, str]] | None = None,
    error: str | None = None,
) -> SpanRecord:
    """A span's record made directly, with no SDK span behind it: what `record_of` gives for
    an internal span of these fields (None attributes left out, as the SDK drops them). For
    spans made whole after the fact from recorded times (a runner's per-task spans, where
    the SDK's span, its attribute checks and `record_of` cost ~half the runner's CPU a task
    at 64 slots of short tasks)."""
    record: SpanRecord = {
        "trace_id": trace_id, "span_id": span_id, "name": name, "kind": "internal",
        "service": service, "start_ns": start_ns, "end_ns": end_ns,
    }
    if parent_id is not None:
        record["parent_id"] = parent_id
    if attributes and (kept := {k: v for k, v in attributes.items() if v is not None}):
        record["attributes"] = kept
    if events:
        record["events"] = events
    if links:
        record["links"] = links
    if error is not None:
        record["status"] = "error"
        if error:
            record["status_message"] = error
    return record


def readable_of(record: SpanRecord, resource: Resource | None = None) -> ReadableSpan:
    """The SDK span a record describes, for exporters that take SDK spans (OTLP). `resource`:
    the process's own, for a span it made (all its attributes, not just the service)."""
    trace_id = int(record["trace_id"], 16)
    parent = None
    if parent_id := record.get("parent_id"):
        parent = SpanContext(trace_id, int(parent_id, 16), is_remote=True, trace_flags=_SAMPLED)
    status = Status(StatusCode.UNSET)
    if record.get("status") == "error":
        status = Status(StatusCode.ERROR, record.get("status_message"))
    return ReadableSpan(
        name=record["name"],
        context=SpanContext(
            trace_id, int(record["span_id"], 16), is_remote=False, trace_flags=_SAMPLED
        ),
        parent=parent,
        resource=resource or _resource(record.get("service", "unknown")),
        attributes=record.get("attributes") or {},
        events=[
            Event(e["name"], e.get("attributes") or {}, e["time_ns"])
            for e in record.get("events", ())
        ],
        links=[
            Link(SpanContext(int(link["trace_id"], 16), int(link["span_id"], 16), is_remote=True))
            for link in record.get("links", ())
        ],
        kind=_KINDS.get(record.get("kind", "internal"), SpanKind.INTERNAL),
        status=status,
        start_time=record["start_ns"],
        end_time=record["end_ns"],
        instrumentation_scope=_scope(record.get("service", "unknown")),
    )


@lru_cache(maxsize=64)
def _resource(service: str) -> Resource:
    return Resource.create({"service.name": service})


@lru_cache(maxsize=64)
def _scope(service: str) -> InstrumentationScope:
    return InstrumentationScope(service.replace("-", "."))
