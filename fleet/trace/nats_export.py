"""Finished spans to `fleet.traces.<trace_id>` (stream FLEET_TRACES, with a max age).

A span processor rather than an exporter behind the SDK's batch thread: spans end on the event
loop, so records are buffered there and published from the loop a moment later, one message
per trace per flush. No span waits on the network. A trace's spans wait for its local roots
here (fleet/trace/held.py): a task's spans, the runner's with them, leave in one message when
its process span ends (was ~1.8 a task at rate: they straddled two flush windows). Core
publishes: the stream stores them, and no ack is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from nats.aio.client import Client
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from fleet.aio import TaskSet
from fleet.trace.held import HeldTraces
from fleet.trace.records import SpanRecord, record_of
from fleet.wire import subjects

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.05  # batches the spans of one task step; far below what a reader notices
MAX_BUFFERED = 20_000  # spans kept while NATS is slow; beyond it new ones are dropped
SPANS_PER_MESSAGE = 200  # well under NATS's default 1 MB payload limit


class NatsSpanProcessor(SpanProcessor):
    def __init__(self, client: Callable[[], Client | None]) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # on_end may come from a thread (asyncio.to_thread)
        self._loop_thread = threading.get_ident()
        # The pending flush (at most one): referenced until it ends, its failure logged.
        self._flushers = TaskSet()
        self._buffer: list[SpanRecord] = []
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
        with self._lock:
            self._held.opened(trace_id)

    def ended(self, record: SpanRecord, local_root: bool) -> None:
        """A sampled span of this process ended: an SDK span or a live one
        (fleet/trace/live.py)."""
        if not local_root:
            self.add([record])
            return
        with self._lock:
            released = self._held.closed(record["trace_id"])
        self.add([*released, record], hold=False)

    def add(self, records: list[SpanRecord], hold: bool = True) -> None:
        """`hold`: records of a trace with a local root open here wait for it (a runner's
        spans re-exported by its worker); False for those a root's end released."""
        now = time.monotonic()
        with self._lock:
            if hold:
                records = [r for r in records if not self._held.hold(r, now)]
            room = MAX_BUFFERED - len(self._buffer) - self._held.count
            self._buffer.extend(records[:room])
            self.dropped += max(0, len(records) - room)
            if self._flush_pending or not (self._buffer or self._held.count):
                return
            self._flush_pending = True
            if self._loop.is_closed():  # its process is ending: nothing will publish these
                self._buffer.clear()
                self._held.release_all()
                self._flush_pending = False
                return
            delay = self._delay(now)
        if threading.get_ident() == self._loop_thread:  # most spans: no wake-up by self-pipe
            self._flush_soon(delay)
            return
        with contextlib.suppress(RuntimeError):  # closed since: as above
            self._loop.call_soon_threadsafe(self._flush_soon, delay)

    def _flush_soon(self, delay: float) -> None:
        """Start the pending flush, in the loop's thread and in a context of its own (not the
        ending span's)."""
        self._flushers.spawn(self._flush_later(delay), context=contextvars.Context())

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
            with self._lock:  # what is still held is due later: keep one flush pending for it
                if self._flush_pending or not self._held.count:
                    return
                self._flush_pending = True
                delay = self._delay(time.monotonic())

    async def flush(self) -> None:
        """Everything buffered and held goes out now (before a connection closes)."""
        await self._flush(everything=True)

    async def _flush(self, everything: bool) -> None:
        with self._lock:
            records, self._buffer = self._buffer, []
            if everything:
                records += self._held.release_all()
            else:
                records += self._held.due(time.monotonic())
            self._flush_pending = False
        if not records:
            return
        client = self._client()
        if client is None or not client.is_connected:
            self.dropped += len(records)
            return
        try:
            for trace_id, spans in _by_trace(records).items():
                for start in range(0, len(spans), SPANS_PER_MESSAGE):
                    body = orjson.dumps({"spans": spans[start : start + SPANS_PER_MESSAGE]})
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


def _by_trace(records: list[SpanRecord]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for record in records:
        grouped.setdefault(record["trace_id"], []).append(record)
    return grouped
