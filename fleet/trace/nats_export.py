"""Finished spans to `fleet.traces.<trace_id>` (stream FLEET_TRACES, with a max age).

A span processor rather than an exporter behind the SDK's batch thread: spans end on the event
loop, so records are buffered there and published from the loop a moment later, one message
per trace per flush. No span waits on the network. Only the loop's thread touches the buffers:
a span that starts or ends in another thread (asyncio.to_thread) is handed to the loop, so
the spans that end on it (nearly all, a few a task) take no lock. A trace's spans wait for its
local roots here (fleet/trace/held.py): a task's spans, the runner's with them, leave in one
message when its process span ends (was ~1.8 a task at rate: they straddled two flush
windows). Core publishes: the stream stores them, and no ack is awaited.

A runner's spans arrive as the JSON it wrote (TraceSpans, one run of a trace's records each)
and are held and published as they are: a message's body is spliced together from this
process's records, dumped at the flush, and those runs (`message_bodies`), never parsed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from nats.aio.client import Client
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from fleet.aio import TaskSet
from fleet.trace.held import HeldTraces
from fleet.trace.records import (
    SPANS_PER_MESSAGE,
    SpanRecord,
    Spans,
    TraceSpans,
    count_of,
    record_of,
    trace_of,
)
from fleet.wire import subjects

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.05  # batches the spans of one task step; far below what a reader notices
MAX_BUFFERED = 20_000  # span records kept (held too) while NATS is slow; beyond, new ones dropped
# Under NATS's default max_payload (1 MiB), with room for the subject and headers. Records
# are far smaller: SPANS_PER_MESSAGE of them are the usual bound.
MAX_MESSAGE_BYTES = 1_000_000


class NatsSpanProcessor(SpanProcessor):
    def __init__(self, client: Callable[[], Client | None]) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()  # the only thread that touches what follows
        # The pending flush (at most one): referenced until it ends, its failure logged.
        self._flushers = TaskSet()
        self._buffer: list[Spans] = []
        self._buffered = 0  # records in _buffer (a runner's run counts its records)
        self._held = HeldTraces()
        self._flush_pending = False
        self.dropped = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        context = span.context
        if context is not None and context.trace_flags.sampled and _is_local_root(span):
            self.opened(format(context.trace_id, "032x"))

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        self.ended(record_of(span), _is_local_root(span))

    def opened(self, trace_id: str) -> None:
        """A local root of this trace started (a sampled one)."""
        if threading.get_ident() != self._loop_thread:
            self._to_loop(self.opened, trace_id)
            return
        self._held.opened(trace_id)

    def ended(self, record: SpanRecord, local_root: bool) -> None:
        """A sampled span of this process ended: an SDK span or a live one
        (fleet/trace/live.py)."""
        if threading.get_ident() != self._loop_thread:
            self._to_loop(self.ended, record, local_root)
        elif not local_root:
            self._add((record,), hold=True)
        else:
            self._add([*self._held.closed(record["trace_id"]), record], hold=False)

    def add(self, spans: Sequence[Spans], hold: bool = True) -> None:
        """`hold`: records of a trace with a local root open here wait for it (a runner's
        spans re-exported by its worker); False for those a root's end released. Past
        MAX_BUFFERED records (buffered and held), a record or run is dropped whole."""
        if threading.get_ident() != self._loop_thread:
            self._to_loop(self.add, spans, hold)
            return
        self._add(spans, hold)

    def _to_loop(self, call: Callable[..., None], *args: Any) -> None:
        """A span's start or end from another thread, done in the loop's, in order behind
        what that thread did before (asyncio.to_thread's result is set after it)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing will publish it
            self._loop.call_soon_threadsafe(call, *args)

    def _add(self, spans: Sequence[Spans], hold: bool) -> None:
        now = time.monotonic()
        room = MAX_BUFFERED - self._buffered - self._held.count
        for item in spans:
            count = count_of(item)
            if count > room:
                self.dropped += count
                continue
            room -= count
            if not (hold and self._held.hold(item, now)):
                self._buffer.append(item)
                self._buffered += count
        if self._flush_pending or not (self._buffer or self._held.count):
            return
        if self._loop.is_closed():  # its process is ending: nothing will publish these
            self._buffer.clear()
            self._buffered = 0
            self._held.release_all()
            return
        self._flush_pending = True
        # In a context of its own, not the ending span's.
        self._flushers.spawn(self._flush_later(self._delay(now)), context=contextvars.Context())

    def _delay(self, now: float) -> float:
        """The next flush: a window after what is ready, or when the first held trace is due."""
        if self._buffer:
            return FLUSH_DELAY_S
        due = self._held.next_due()
        return FLUSH_DELAY_S if due is None else max(FLUSH_DELAY_S, due - now)

    async def _flush_later(self, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)  # a batching window or a hold's end, not synchronisation
            await self._flush(everything=False)
            # What is still held is due later: keep one flush pending for it.
            if self._flush_pending or not self._held.count:
                return
            self._flush_pending = True
            delay = self._delay(time.monotonic())

    async def flush(self) -> None:
        """Everything buffered and held goes out now (before a connection closes)."""
        await self._flush(everything=True)

    async def _flush(self, everything: bool) -> None:
        spans, self._buffer, self._buffered = self._buffer, [], 0
        if everything:
            spans += self._held.release_all()
        else:
            spans += self._held.due(time.monotonic())
        self._flush_pending = False
        if not spans:
            return
        client = self._client()
        if client is None or not client.is_connected:
            self.dropped += sum(count_of(item) for item in spans)
            return
        try:
            for trace_id, of_trace in _by_trace(spans).items():
                for body in message_bodies(of_trace):
                    await client.publish(subjects.traces(trace_id), body)
        except Exception as exc:  # telemetry must never take its process down
            log.debug("publishing spans failed: %s", exc)

    def shutdown(self) -> None:
        pass  # publishing needs the connection's loop: owners await flush() before closing

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # as above: the SDK's synchronous flush cannot drive the event loop


def _is_local_root(span: ReadableSpan) -> bool:
    """Started here with no parent, or under one from another process (a message's headers)."""
    return span.parent is None or span.parent.is_remote


def _by_trace(spans: list[Spans]) -> dict[str, list[Spans]]:
    grouped: dict[str, list[Spans]] = {}
    for item in spans:
        grouped.setdefault(trace_of(item), []).append(item)
    return grouped


def message_bodies(
    spans: list[Spans], max_spans: int = SPANS_PER_MESSAGE,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> list[bytes]:
    """One trace's spans as `{"spans": [...]}` message bodies, in their order: each of this
    process's records dumped (runs of them in one dump), each runner's run spliced in as it
    was written. A message takes at most `max_spans` records and `max_bytes` bytes, but for a
    run larger than that alone (a runner sends runs of at most SPANS_PER_MESSAGE records)."""
    pieces: list[tuple[int, bytes]] = []  # (records, their JSON comma-joined)
    own: list[SpanRecord] = []
    for item in [*spans, None]:  # None: the end, where the last records of ours are dumped
        if isinstance(item, dict):
            own.append(item)
            continue
        for start in range(0, len(own), max_spans):
            chunk = own[start : start + max_spans]
            pieces.append((len(chunk), orjson.dumps(chunk)[1:-1]))
        own = []
        if isinstance(item, TraceSpans):
            pieces.append((item.count, item.body))
    bodies: list[bytes] = []
    message: list[bytes] = []
    records = size = 0
    for count, piece in pieces:
        if message and (records + count > max_spans or size + len(piece) + 1 > max_bytes):
            bodies.append(_body(message))
            message, records, size = [], 0, 0
        message.append(piece)
        records += count
        size += len(piece) + 1
    if message:
        bodies.append(_body(message))
    return bodies


def _body(pieces: list[bytes]) -> bytes:
    return b'{"spans":[' + b",".join(pieces) + b"]}"
