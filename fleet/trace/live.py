"""Spans that become records when they end, with no SDK span behind them: the worker's per-task
spans (`process fleet.tasks.<model>`, its children, the `send` spans of what it publishes).

The SDK's span (its sampler call, bounded attributes, locks, span processors, then `record_of`
at its end) cost ~15-20 % of a worker's CPU a task at rate (issue 23). A `LiveSpan` is an
OpenTelemetry API span, so it can be made current, carried in headers and read back by
`trace.get_current_span()` like any other; at its end it is one record (fleet.trace.records)
handed to its sink, which exports it where the process's SDK spans go (NATS, OTLP).

Sampling is the SDK's: its default (parent-based, always on) decided here from the parent's
flag; any other sampler the process configured is asked. A span not sampled is a
`NonRecordingSpan`, as the SDK makes it, and costs nothing more.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    TraceFlags,
    TraceState,
    format_span_id,
    format_trace_id,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.status import Status, StatusCode
from opentelemetry.util import types

from fleet.trace.records import SpanRecord

_KIND_NAMES = {kind: kind.name.lower() for kind in SpanKind}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)

# (record, local root) once a span ends; a local root's trace id when it starts
Ended = Callable[[SpanRecord, bool], None]
Opened = Callable[[str], None]


class LiveSpan(Span):
    """A recording span that is a record in the making. Not thread-safe: a worker's spans are
    started and ended on its event loop."""

    __slots__ = ("_attributes", "_context", "_ended", "_events", "_links", "_local_root",
                 "_message", "_name", "_parent_id", "_sink", "_span_id", "_status", "record",
                 "trace_id", "trace_state")

    def __init__(
        self, sink: Ended, name: str, ids: tuple[int, int, TraceState | None],
        parent_id: str | None, record: SpanRecord, attributes: dict[str, Any],
        local_root: bool,
    ) -> None:
        self._sink = sink
        self._name = name
        self.trace_id, self._span_id, self.trace_state = ids  # its children's
        self._context: SpanContext | None = None  # made when asked: most never are
        self._parent_id = parent_id
        self.record = record  # what is known at the start: ids, kind, service, start
        self._attributes = attributes
        self._events: list[dict[str, Any]] = []
        self._links: list[dict[str, str]] = []
        self._status = StatusCode.UNSET
        self._message: str | None = None
        self._local_root = local_root
        self._ended = False

    def get_span_context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(self.trace_id, self._span_id, False, _SAMPLED,
                                        self.trace_state)
        return self._context

    @property
    def carrier(self) -> dict[str, str]:
        """The W3C trace context headers that name this span the parent (what the
        tracecontext propagator writes, without its cost)."""
        headers = {"traceparent": f"00-{self.record['trace_id']}-{self.record['span_id']}-01"}
        if self.trace_state:  # most have none: no formatting
            headers["tracestate"] = self.trace_state.to_header()
        return headers

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        # As the SDK: a None dropped, nothing changed once ended (the record is sent).
        if value is not None and not self._ended:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        if self._ended:
            return
        self._events.append({"name": name, "time_ns": timestamp or time.time_ns(),
                             "attributes": dict(attributes or {})})

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if context.is_valid and not self._ended:
            self._links.append({"trace_id": format_trace_id(context.trace_id),
                                "span_id": format_span_id(context.span_id)})

    def update_name(self, name: str) -> None:
        if not self._ended:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK: OK is final, ERROR holds its description, UNSET changes nothing."""
        if isinstance(status, Status):
            code, description = status.status_code, status.description
        else:
            code = status
        if self._ended or code is StatusCode.UNSET or self._status is StatusCode.OK:
            return
        self._status, self._message = code, description if code is StatusCode.ERROR else None

    def record_exception(
        self, exception: BaseException, attributes: types.Attributes = None,
        timestamp: int | None = None, escaped: bool = False,
    ) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        self.add_event("exception", {
            "exception.type": f"{module}.{qualname}" if module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        record = self.record
        record["name"] = self._name
        record["end_ns"] = end_time or time.time_ns()
        if self._parent_id is not None:
            record["parent_id"] = self._parent_id
        if self._attributes:
            record["attributes"] = self._attributes
        if self._events:
            record["events"] = self._events
        if self._links:
            record["links"] = self._links
        if self._status is StatusCode.ERROR:
            record["status"] = "error"
            if self._message:
                record["status_message"] = self._message
        self._sink(record, self._local_root)

    def __repr__(self) -> str:
        return f"LiveSpan({self._name!r}, {self.record['trace_id']}, {self.record['span_id']})"


class Within:
    """`with Within(span):` the SDK's `start_as_current_span` for a span already started:
    current in the block (in `context`, else the current context; not at all for `current`
    False), a failure recorded on it, ended after. A class: a generator's context manager
    costs twice as much, once a task's terminal at least."""

    __slots__ = ("_context", "_current", "_span", "_token")

    def __init__(self, span: Span, context: Context | None = None, current: bool = True) -> None:
        self._span = span
        self._context = context
        self._current = current
        self._token: object = None

    def __enter__(self) -> Span:
        if self._current:
            self._token = otel_context.attach(set_span_in_context(self._span, self._context))
        return self._span

    def __exit__(self, kind: object, failure: BaseException | None, tb: object) -> None:
        if isinstance(failure, Exception):  # as the SDK's use_span: not GeneratorExit and such
            self._span.record_exception(failure)
            self._span.set_status(StatusCode.ERROR, f"{type(failure).__name__}: {failure}")
        if self._current:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        self._span.end()


class LiveSpans:
    """Starts live spans for one process: its service name, its sampler, where records go."""

    def __init__(
        self, service: str, sampler: sampling.Sampler, opened: Opened, ended: Ended
    ) -> None:
        self._service = service
        # The SDK's default decides from the parent's flag alone: no call needed for it.
        self._sampler = None if sampler is sampling.DEFAULT_ON else sampler
        self.parent_based = self._sampler is None  # a span is sampled as its parent is
        self._opened = opened
        self._ended = ended

    def start(
        self, name: str, kind: SpanKind, context: Context | None,
        attributes: dict[str, Any], links: Sequence[Link] = (),
    ) -> Span:
        """A span under `context`'s span (the current one for None). `attributes` becomes
        the span's own: a fresh dict, no None values."""
        parent_span = get_current_span(context)
        if isinstance(parent_span, LiveSpan) and self._sampler is None:
            # Under a span of this process's (a task's send span under its process span):
            # sampled as it is, its ids at hand.
            parent = parent_span.record
            return self._recording(name, kind, (parent_span.trace_id, parent_span.trace_state),
                                   parent["trace_id"], parent["span_id"], False, attributes,
                                   links)
        parent_context = parent_span.get_span_context()
        if parent_context.is_valid:
            trace_id, trace_state = parent_context.trace_id, parent_context.trace_state
            sampled = parent_context.trace_flags.sampled
        else:
            trace_id, trace_state = random.getrandbits(128) or 1, None  # the SDK's ids
            sampled = True
        if self._sampler is not None:
            decided = self._sampler.should_sample(context, trace_id, name, kind, attributes,
                                                  links)
            sampled, trace_state = decided.decision.is_sampled(), decided.trace_state
            if decided.attributes:
                attributes.update(decided.attributes)
        if not sampled:
            return NonRecordingSpan(SpanContext(trace_id, random.getrandbits(64) or 1, False,
                                                _NOT_SAMPLED, trace_state))
        if not parent_context.is_valid:
            return self._recording(name, kind, (trace_id, trace_state),
                                   format(trace_id, "032x"), None, True, attributes, links)
        return self._recording(name, kind, (trace_id, trace_state), format(trace_id, "032x"),
                               format(parent_context.span_id, "016x"),
                               parent_context.is_remote, attributes, links)

    def _recording(
        self, name: str, kind: SpanKind, trace: tuple[int, TraceState | None], trace_hex: str,
        parent_id: str | None, local_root: bool, attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> LiveSpan:
        if local_root:
            self._opened(trace_hex)
        span_id = random.getrandbits(64) or 1  # the SDK's ids
        record: SpanRecord = {
            "trace_id": trace_hex, "span_id": format(span_id, "016x"), "name": name,
            "kind": _KIND_NAMES[kind], "service": self._service, "start_ns": time.time_ns(),
        }
        span = LiveSpan(self._ended, name, (trace[0], span_id, trace[1]), parent_id, record,
                        attributes, local_root)
        for link in links:
            span.add_link(link.context)
        return span
