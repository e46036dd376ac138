"""Span records: an SDK span to JSON and back, for the runner pipe and the OTLP re-export."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from fleet.telemetry import carried, context_of, destination_template
from fleet.trace.records import made, readable_of, record_of


def finished_spans() -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("parent") as parent:
        child = tracer.start_span(
            "process fleet.tasks.m", kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "fleet.delivery": 2, "tags": ("a", "b")},
            links=[Link(parent.get_span_context())],
        )
        child.add_event("ack", {"n": 1})
        child.set_status(Status(StatusCode.ERROR, "boom"))
        child.end()
    return list(exporter.get_finished_spans())


def test_a_record_survives_the_round_trip_through_an_sdk_span() -> None:
    child, parent = finished_spans()
    record = record_of(child)
    assert record["parent_id"] == format(parent.context.span_id, "016x")
    assert record["kind"] == "consumer"
    assert record["status"] == "error" and record["status_message"] == "boom"
    assert record_of(readable_of(record)) == record


def test_a_root_record_has_no_parent_and_no_empty_fields() -> None:
    _, parent = finished_spans()
    assert set(record_of(parent)) == {
        "trace_id", "span_id", "name", "kind", "service", "start_ns", "end_ns",
    }


def test_context_travels_through_traceparent_and_back() -> None:
    _, parent = finished_spans()
    assert parent.context is not None
    traceparent, _ = carried(NonRecordingSpan(parent.context))
    assert traceparent is not None
    context = context_of(traceparent, None)
    carried_back = trace.get_current_span(context).get_span_context()
    assert (carried_back.trace_id, carried_back.span_id) == (
        parent.context.trace_id, parent.context.span_id,
    )


def test_per_task_subjects_are_named_by_their_template() -> None:
    assert destination_template("fleet.tasks.tiny-llm") == "fleet.tasks.tiny-llm"
    assert destination_template("fleet.out.chat-1") == "fleet.out.{task_id}"


def test_a_record_made_directly_reads_as_the_sdk_spans_record() -> None:
    """`made` (a runner's per-task spans, no SDK span behind them) gives what `record_of`
    gives for the same internal span, None attributes dropped as the SDK drops them."""
    exported = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "fleet-runner"}))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    parent = SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    span = provider.get_tracer("t").start_span(
        "chat m", context=set_span_in_context(NonRecordingSpan(parent)), start_time=10,
        attributes={"a": 1, "b": ("stop",)},
    )
    span.set_attribute("c", "x")
    span.set_status(Status(StatusCode.ERROR, "boom"))
    span.end(end_time=20)
    sdk = record_of(exported.get_finished_spans()[0])
    direct = made("chat m", trace_id=sdk["trace_id"], span_id=sdk["span_id"],
                  parent_id=format(0xCD, "016x"), service="fleet-runner", start_ns=10, end_ns=20,
                  attributes={"a": 1, "b": ("stop",), "c": "x", "gone": None}, error="boom")
    assert direct == sdk
