"""Live spans (fleet/trace/live.py): the worker's per-task spans made as records from the start.
Each gives the record the SDK's span gives for the same calls, follows the SDK's sampling, and
is exported where the SDK's spans go (the NATS processor's held traces, OTLP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from fleet import telemetry
from fleet.trace.live import LiveSpan, LiveSpans
from fleet.trace.records import SpanRecord, readable_of, record_of

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
REMOTE = SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=SAMPLED,
                     trace_state=TraceState([("vendor", "v1")]))


def under(context: SpanContext) -> Context:
    return set_span_in_context(NonRecordingSpan(context))


class Sink:
    def __init__(self) -> None:
        self.opened: list[str] = []
        self.ended: list[tuple[SpanRecord, bool]] = []

    def spans(self, sampler: sampling.Sampler = sampling.DEFAULT_ON) -> LiveSpans:
        return LiveSpans("fleet-worker", sampler, self.opened.append,
                         lambda record, root: self.ended.append((record, root)))


Calls = Callable[[Span], None]


def events(span: Span) -> None:
    span.add_event("dispatch", {"fleet.runner.id": "r1"}, timestamp=15)
    span.add_event("ack", timestamp=16)


def error(span: Span) -> None:
    span.set_attribute("fleet.task.status", "failed")
    span.set_status(Status(StatusCode.ERROR, "boom"))


def ok_is_final(span: Span) -> None:
    span.set_status(StatusCode.OK)
    span.set_status(Status(StatusCode.ERROR, "late"))


def unset_changes_nothing(span: Span) -> None:
    span.set_status(Status(StatusCode.ERROR, "boom"))
    span.set_status(StatusCode.UNSET)


def after_the_end(span: Span) -> None:
    span.end(end_time=20)
    span.set_attribute("late", 1)
    span.end(end_time=30)


@pytest.mark.parametrize(("kind", "attributes", "calls"), [
    (SpanKind.CONSUMER, {"messaging.system": "nats", "fleet.delivery": 2}, events),
    (SpanKind.PRODUCER, {"messaging.message.body.size": 10}, error),
    (SpanKind.INTERNAL, {}, ok_is_final),
    (SpanKind.INTERNAL, {"a": 1}, unset_changes_nothing),
    (SpanKind.CONSUMER, {"a": 1}, after_the_end),
    (SpanKind.INTERNAL, {"a": ("x", "y")}, lambda span: span.set_attributes({"b": 1.5})),
])
def test_a_live_span_records_what_the_sdk_span_records(
    kind: SpanKind, attributes: dict[str, Any], calls: Calls
) -> None:
    exported = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "fleet-worker"}))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    sdk_span = provider.get_tracer("t").start_span("s", under(REMOTE), kind, dict(attributes),
                                                   start_time=10)
    sink = Sink()
    live = sink.spans().start("s", kind, under(REMOTE), dict(attributes))
    for span in (sdk_span, live):
        calls(span)
        span.end(end_time=20)
    sdk = record_of(exported.get_finished_spans()[0])
    [(record, local_root)] = sink.ended
    assert local_root and sink.opened == [record["trace_id"]]
    assert record["start_ns"] > 0
    assert record | {"span_id": sdk["span_id"], "start_ns": 10} == sdk
    assert live.get_span_context().trace_state == REMOTE.trace_state


def test_a_child_of_a_local_span_is_no_local_root_and_a_root_starts_its_own_trace() -> None:
    sink = Sink()
    spans = sink.spans()
    root = spans.start("process", SpanKind.CONSUMER, Context(), {})
    child = spans.start("send", SpanKind.PRODUCER, set_span_in_context(root), {})
    child.end()
    root.end()
    (child_record, child_root), (root_record, root_root) = sink.ended
    assert (child_root, root_root) == (False, True)
    assert child_record["parent_id"] == root_record["span_id"]
    assert "parent_id" not in root_record
    assert child_record["trace_id"] == root_record["trace_id"] == sink.opened[0]


def test_a_child_of_a_local_span_keeps_its_trace_and_trace_state() -> None:
    spans = Sink().spans()
    process = spans.start("process", SpanKind.CONSUMER, under(REMOTE), {})
    send = spans.start("send", SpanKind.PRODUCER, set_span_in_context(process), {})
    context = send.get_span_context()
    assert (context.trace_id, context.trace_state, context.trace_flags.sampled) == (
        REMOTE.trace_id, REMOTE.trace_state, True)
    assert context.span_id not in (REMOTE.span_id, process.get_span_context().span_id)


@pytest.mark.parametrize(("parent_flags", "sampler", "recorded"), [
    (TraceFlags.SAMPLED, sampling.DEFAULT_ON, True),
    (TraceFlags.DEFAULT, sampling.DEFAULT_ON, False),  # the parent's flag, as the SDK
    (TraceFlags.SAMPLED, sampling.ALWAYS_OFF, False),  # another sampler is asked
    (TraceFlags.DEFAULT, sampling.ALWAYS_ON, True),
])
def test_a_span_is_sampled_as_the_sdk_samples_it(
    parent_flags: int, sampler: sampling.Sampler, recorded: bool
) -> None:
    parent = SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=TraceFlags(parent_flags))
    sink = Sink()
    span = sink.spans(sampler).start("s", SpanKind.CONSUMER, under(parent), {})
    span.end()
    context = span.get_span_context()
    assert (span.is_recording() or bool(sink.ended), isinstance(span, LiveSpan)) == (
        recorded, recorded)
    assert context.trace_id == 0xAB and context.span_id != 0xCD
    assert context.trace_flags.sampled is recorded
    assert bool(sink.opened) is recorded


def test_its_headers_are_what_the_propagator_writes() -> None:
    span = Sink().spans().start("s", SpanKind.CONSUMER, under(REMOTE), {})
    assert isinstance(span, LiveSpan)
    injected: dict[str, str] = {}
    propagate.inject(injected, context=set_span_in_context(span))
    assert span.carrier == injected
    assert telemetry.carried(span) == (injected["traceparent"], injected["tracestate"])
    assert telemetry.carried(trace.INVALID_SPAN) == (None, None)


def test_its_otlp_form_keeps_the_process_resource() -> None:
    resource = Resource.create({"service.name": "fleet-worker", "fleet.node.id": "n1"})
    sink = Sink()
    sink.spans().start("s", SpanKind.CONSUMER, under(REMOTE), {"a": 1}).end()
    readable = readable_of(sink.ended[0][0], resource)
    assert readable.resource is resource
    assert record_of(readable) == sink.ended[0][0]


class Exported:
    """Where the NATS processor takes a live span (`opened`, `ended`)."""

    def __init__(self) -> None:
        self.records: list[tuple[SpanRecord, bool]] = []
        self.roots: list[str] = []

    def opened(self, trace_id: str) -> None:
        self.roots.append(trace_id)

    def ended(self, record: SpanRecord, local_root: bool) -> None:
        self.records.append((record, local_root))


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Exported:
    """A process's telemetry whose live spans go to `Exported`, as to the NATS processor."""
    exported = Exported()
    installed = telemetry.Telemetry(
        TracerProvider(resource=Resource.create({"service.name": "fleet-worker"})), None)
    installed.nats = exported  # type: ignore[assignment]
    monkeypatch.setattr(telemetry, "_installed", installed)
    return exported


def test_a_send_span_is_current_while_it_sends_and_names_itself_in_the_headers(
    installed: Exported,
) -> None:
    process = telemetry.start_span("process fleet.tasks.m", SpanKind.CONSUMER, under(REMOTE), {})
    headers: dict[str, str] = {}
    with (trace.use_span(process, end_on_exit=True),
          telemetry.send_span("fleet.out.t1", "t1-end", 12) as send):
        assert trace.get_current_span() is send
        telemetry.inject_headers(headers)
    (sent, sent_root), (processed, processed_root) = installed.records
    assert headers["traceparent"] == f"00-{sent['trace_id']}-{sent['span_id']}-01"
    assert (sent["name"], sent["kind"], sent["parent_id"]) == (
        "send fleet.out.{task_id}", "producer", processed["span_id"])
    assert sent["attributes"] == {
        "messaging.system": "nats", "messaging.operation.type": "send",
        "messaging.operation.name": "publish", "messaging.destination.name": "fleet.out.t1",
        "messaging.message.body.size": 12, "messaging.destination.template": "fleet.out.{task_id}",
        "messaging.message.id": "t1-end",
    }
    assert (sent_root, processed_root) == (False, True)
    assert installed.roots == [processed["trace_id"]]


def test_a_send_span_records_the_failure_it_ends_in(installed: Exported) -> None:
    with pytest.raises(ValueError), telemetry.send_span("fleet.tasks.m", None, 1):
        raise ValueError("refused")
    [(record, _)] = installed.records
    assert (record["status"], record["status_message"]) == ("error", "ValueError: refused")
    assert record["events"][0]["name"] == "exception"


def test_nothing_is_made_where_the_sdk_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_installed", None)
    before = trace.get_current_span()
    with telemetry.send_span("fleet.tasks.m", None, 1) as span:
        assert span is trace.INVALID_SPAN and trace.get_current_span() is before
    assert telemetry.start_span("s", SpanKind.CONSUMER, None, {}) is trace.INVALID_SPAN


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("headers", [
    None, {}, {"Nats-Msg-Id": "t1"},
    {"traceparent": TRACEPARENT},
    {"traceparent": TRACEPARENT, "tracestate": "vendor=v1,other=o2"},
    {"traceparent": TRACEPARENT.replace("-01", "-00")},
    {"traceparent": TRACEPARENT, "baggage": "tenant=a"},
    {"baggage": "tenant=a"},
    {"traceparent": "ff" + TRACEPARENT[2:]},
    {"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"},
    {"traceparent": TRACEPARENT + "-extra"},
    {"traceparent": "not one"},
])
def test_a_context_read_from_headers_is_what_the_propagators_read(
    headers: dict[str, str] | None,
) -> None:
    """extract_context reads W3C trace context itself where the propagators are the default
    ones and there is no baggage: the same context as theirs."""
    expected = propagate.extract(dict(headers or {}))
    got = telemetry.extract_context(headers)
    assert trace.get_current_span(got).get_span_context() == (
        trace.get_current_span(expected).get_span_context())
    assert dict(baggage.get_all(got)) == dict(baggage.get_all(expected))
