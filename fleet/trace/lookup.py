"""A task's trace, read from JetStream alone (the `fleet trace` command is
fleet/commands/trace.py; the dashboard reads traces here too). The id of a gateway request with
n > 1 choices works too: its choices share its trace.

A task's trace id is in its `task_accepted` on `fleet.out.<task_id>`; a task that ended before
any runner accepted it still names its trace in the `traceparent` of its events. The spans
are the `{"spans": [...]}` messages stored on `fleet.traces.<trace_id>`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

import orjson
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from fleet.trace.records import SpanRecord
from fleet.wire import subjects
from fleet.wire.codec import DecodeError, decode_event
from fleet.wire.events import TaskAccepted

_HEX = frozenset("0123456789abcdef")


def is_trace_id(text: str) -> bool:
    return len(text) == 32 and set(text) <= _HEX and text != "0" * 32


def trace_id_in(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and is_trace_id(parts[1]) else None


async def stored(js: JetStreamContext, stream: str, subject: str) -> AsyncIterator[RawStreamMsg]:
    """Every message a stream holds on one subject, oldest first, without a consumer (the
    spans in FLEET_TRACES; a task's events are read through its task log)."""
    try:
        info = await js.stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        return
    count = (info.state.subjects or {}).get(subject, 0)
    seq = 0
    for _ in range(count):
        try:
            msg = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except NotFoundError:  # aged out meanwhile
            return
        seq = msg.seq or seq + 1
        yield msg


class StoredEvents(Protocol):
    """A task's stored events, oldest first, with their headers: the task log
    (fleet.bus.task_log.TaskLog, each get retried within its budget), passed in by the caller
    (the bus imports telemetry, which imports this package's records: no import back)."""

    def each(self, task_id: str) -> AsyncIterator[RawStreamMsg]: ...


async def trace_id_of_task(log: StoredEvents, task_id: str) -> str | None:
    """Read up to the task's accept: usually its first event."""
    from_headers = None
    messages = log.each(task_id)
    async with contextlib.aclosing(messages):
        async for msg in messages:
            try:
                event = decode_event(msg.data or b"")
            except DecodeError:
                continue
            if isinstance(event, TaskAccepted) and event.trace_id:
                return event.trace_id
            from_headers = from_headers or trace_id_in((msg.headers or {}).get("traceparent"))
            if isinstance(event, TaskAccepted) and from_headers:
                break  # the runner's acceptance names no trace: the headers are all there is
    return from_headers


async def trace_id_of_request(log: StoredEvents, task_id: str) -> str | None:
    """The trace of a task, or of a gateway request with n > 1 choices: its id names no task,
    its choices are the tasks `<id>-0` … `<id>-<n-1>`, all in the request's one trace."""
    return await trace_id_of_task(log, task_id) or await trace_id_of_task(log, f"{task_id}-0")


async def spans_of_trace(js: JetStreamContext, trace_id: str) -> list[SpanRecord]:
    """The trace's spans, each once (by span id), in the order they were stored."""
    found: dict[str, SpanRecord] = {}
    async for msg in stored(js, subjects.TRACES_STREAM, subjects.traces(trace_id)):
        try:
            batch = orjson.loads(msg.data or b"{}")
        except orjson.JSONDecodeError:
            continue
        for record in batch.get("spans", ()) if isinstance(batch, dict) else ():
            if isinstance(record, dict) and "span_id" in record:
                found.setdefault(record["span_id"], record)
    return list(found.values())


async def linked_spans(
    js: JetStreamContext, spans: list[SpanRecord], after_ns: int
) -> list[SpanRecord]:
    """Spans of the traces `spans` link to (a runner's start) that were still running after
    `after_ns`: work this trace waited on, though it was no part of it."""
    own = {record["trace_id"] for record in spans}
    linked = {
        link["trace_id"] for record in spans for link in record.get("links", ())
    } - own
    found: list[SpanRecord] = []
    for trace_id in sorted(linked):
        records = await spans_of_trace(js, trace_id)
        if any(record["end_ns"] > after_ns for record in records):
            found.extend(records)
    return found
