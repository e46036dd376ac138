"""`fleet trace <task_id> [--chrome FILE]`: a task's trace as a waterfall, from JetStream alone.
The id of a gateway request with n > 1 choices works too: its choices share its trace.

A task's trace id is in its `task_accepted` on `fleet.out.<task_id>`; a task that ended before
any runner accepted it still names its trace in the `traceparent` of its events. The spans
are the `{"spans": [...]}` messages stored on `fleet.traces.<trace_id>`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from fleet.bus.connect import connect_with
from fleet.config import Settings, settings_of
from fleet.errors import FleetError
from fleet.trace.records import SpanRecord
from fleet.trace.render import chrome_trace, waterfall
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
    """Every message a stream holds on one subject, oldest first, without a consumer."""
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


async def trace_id_of_task(js: JetStreamContext, task_id: str) -> str | None:
    from_headers = None
    async for msg in stored(js, subjects.OUT_STREAM, subjects.out(task_id)):
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


async def trace_id_of_request(js: JetStreamContext, task_id: str) -> str | None:
    """The trace of a task, or of a gateway request with n > 1 choices: its id names no task,
    its choices are the tasks `<id>-0` … `<id>-<n-1>`, all in the request's one trace."""
    return await trace_id_of_task(js, task_id) or await trace_id_of_task(js, f"{task_id}-0")


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


async def load_trace(settings: Settings, task_or_trace: str) -> tuple[str, list[SpanRecord]]:
    """The trace's id and its spans, plus those of linked traces that overlap it."""
    nc = await connect_with(settings, "fleet-trace")
    try:
        js = nc.jetstream()
        trace_id = task_or_trace if is_trace_id(task_or_trace) else None
        trace_id = trace_id or await trace_id_of_request(js, task_or_trace)
        if trace_id is None:
            raise FleetError(f"no trace found for task {task_or_trace}: unknown, or expired")
        spans = await spans_of_trace(js, trace_id)
        if spans:
            spans += await linked_spans(js, spans, min(span["start_ns"] for span in spans))
    finally:
        await nc.close()
    return trace_id, spans


def cmd_trace(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    trace_id, spans = asyncio.run(load_trace(settings, args.task_id))
    if not spans:
        raise FleetError(f"trace {trace_id} has no spans in FLEET_TRACES (expired, or disabled)")
    columns = shutil.get_terminal_size((140, 40)).columns
    bar_width = max(20, min(60, columns - 100))
    for line in waterfall(spans, bar_width=bar_width):
        print(line)
    if args.chrome:
        document: dict[str, Any] = chrome_trace(spans)
        Path(args.chrome).write_bytes(orjson.dumps(document))
        print(f"wrote {args.chrome}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace", help="a task's trace as a waterfall (spans stored in FLEET_TRACES)"
    )
    parser.add_argument("task_id", help="a task id, or a trace id (32 hex digits)")
    parser.add_argument("--chrome", type=Path, help="also write Chrome trace JSON here (Perfetto)")
    parser.set_defaults(func=cmd_trace)
