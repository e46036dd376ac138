"""Finished spans to `fleet.traces.<trace_id>` (stream FLEET_TRACES, with a max age).

A span processor rather than an exporter behind the SDK's batch thread: spans end on the event
loop, so records are buffered there and published from the loop a moment later, one message
per trace per flush. No span waits on the network, and the spans of one task that end
together travel together. Core publishes: the stream stores them, and no ack is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import orjson
from nats.aio.client import Client
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

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
        self._buffer: list[SpanRecord] = []
        self._flush_pending = False
        self.dropped = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.add([record_of(span)])

    def add(self, records: list[SpanRecord]) -> None:
        with self._lock:
            room = MAX_BUFFERED - len(self._buffer)
            self._buffer.extend(records[:room])
            self.dropped += max(0, len(records) - room)
            if self._flush_pending:
                return
            self._flush_pending = True
            if self._loop.is_closed():  # its process is ending: nothing will publish these
                self._buffer.clear()
                self._flush_pending = False
                return
        with contextlib.suppress(RuntimeError):  # closed since: as above
            asyncio.run_coroutine_threadsafe(self._flush_later(), self._loop)

    async def _flush_later(self) -> None:
        await asyncio.sleep(FLUSH_DELAY_S)  # a batching window, not synchronisation
        await self.flush()

    async def flush(self) -> None:
        with self._lock:
            records, self._buffer = self._buffer, []
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


def _by_trace(records: list[SpanRecord]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for record in records:
        grouped.setdefault(record["trace_id"], []).append(record)
    return grouped
