"""The one SSE response of the gateway and the dashboard: frames, keep-alives, a send timeout
and the one hang-up watcher.

`EventStream` sends each chunk its producer (an async iterator of bytes) yields. While no chunk
is ready for `keepalive_s` it sends the keep-alive frame (a comment by default; Anthropic's
`ping` event for a Messages stream), so that proxies and clients that drop a silent connection
keep it. A send that waits more than `send_timeout_s` (the client stopped reading: uvicorn's
send waits while the socket's buffers are full) counts as a hang-up, so a stuck socket cannot
hold a place in the gateway's capacity forever. A hang-up (http.disconnect, a write error or
the send timeout) cancels the producer and is reported to `on_close(hung_up=True)`.

`hung_up(receive)` is the watcher, and `unless_hung_up` the same watch over work that runs
before the response begins (a whole answer, or a stream before its first token).

sse-starlette (3.7.1, read and tried against this module's needs) is not used: importing it
replaces `uvicorn.Server.handle_exit` for every server in the process (the gateway handles
its own signals, fleet/gateway/app.py), its ping is sent on a timer whether or not data flows
(under a lock shared with the data), its close callback is called for an http.disconnect only
(not for a write error or a send timeout, the two ways a stuck client ends), and it starts no
stream before its response does, where a Messages stream here begins before its relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from fleet.aio import CLOSE_WAIT_S, log_failure
from fleet.errors import FleetError
from fleet.gateway.errors import error_body

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0  # under the 30-60 s that proxies and SDKs allow a silent connection
SEND_TIMEOUT_S = 30.0  # a client that reads nothing for this long is gone
KEEPALIVE = b": keep-alive\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

R = TypeVar("R")
OnClose = Callable[[bool], Awaitable[None]]


def sse(data: Any, event: str | None = None, event_id: int | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    if event_id is not None:
        head += f"id: {event_id}\n"
    return head.encode() + b"data: " + orjson.dumps(data) + b"\n\n"


def sse_error(exc: FleetError) -> bytes:
    """Mid-stream failure: OpenAI's SDKs raise on an `error` event whose data has `error`."""
    return sse(error_body(exc), event="error")


async def hung_up(receive: Receive) -> None:
    """Returns when the client hangs up (the request's body has been read already). A
    `receive` that fails is logged and counts as a hang-up: the watcher's task ends without
    an error nobody would read."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        log.exception("the server's receive failed: the client is taken for gone")


async def unless_hung_up(receive: Receive, waiting: Awaitable[R]) -> R | None:
    """What `waiting` gives, or None when the client hangs up first (and `waiting` is
    cancelled). Before any byte of the response is out, only this notices a client that gave
    up: an SDK that timed out and retries would otherwise leave its first task running."""
    work = asyncio.ensure_future(waiting)
    watcher = asyncio.ensure_future(hung_up(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return work.result() if not work.cancelled() else None


class EventStream(Response):
    """An SSE response over `lines`; `on_close(hung_up)` runs once when it ends, however."""

    media_type = "text/event-stream"

    def __init__(
        self,
        lines: AsyncIterator[bytes],
        on_close: OnClose | None = None,
        *,
        keepalive: bytes = KEEPALIVE,
        keepalive_s: float | None = None,
        send_timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.lines = lines
        self.on_close = on_close
        self.keepalive = keepalive
        # Read here, not bound as defaults: a test sets the module's constants.
        self.keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        self.send_timeout_s = SEND_TIMEOUT_S if send_timeout_s is None else send_timeout_s
        self.status_code = 200
        self.background = None
        self.init_headers({**HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False
        try:
            gone = await self.pump(receive, send)
        finally:
            if self.on_close is not None:
                await self.on_close(gone)

    async def pump(self, receive: Receive, send: Send) -> bool:
        """Send the headers, every line and the end; True when the client hung up first.

        The producer runs in a task of its own, a few chunks ahead (AHEAD), so that a chunk
        that is ready costs a queue read: an `anext` task per chunk raced with the watcher
        cost 80-120 us a chunk, against 1-2 for Starlette's StreamingResponse (measured on
        the shared 2-core machine)."""
        # The keep-alive is an SSE frame: a body of another type (Ollama's NDJSON) gets none.
        sse_body = self.headers.get("content-type", "").startswith("text/event-stream")
        keepalive = self.keepalive if sse_body else b""
        ready: asyncio.Queue[Any] = asyncio.Queue(AHEAD)
        clock = self._clock = _Clock()
        watcher = asyncio.ensure_future(_watch(receive, ready))
        feeding = asyncio.ensure_future(_feed(self.lines, ready))
        try:
            start = {"type": "http.response.start", "status": self.status_code,
                     "headers": self.raw_headers}
            if not await self._send(send, start, watcher):
                return True
            while not watcher.done():
                if ready.empty():
                    got, item = await clock.within(self.keepalive_s, ready.get())
                    if not got:
                        if keepalive and not await self._send(send, _body(keepalive), watcher):
                            return True
                        continue
                else:
                    item = ready.get_nowait()
                if item is _HUNG_UP:
                    return True
                if item is _END:
                    end = {"type": "http.response.body", "body": b"", "more_body": False}
                    return not await self._send(send, end, watcher)
                if isinstance(item, _Failed):
                    raise item.exc
                if item and not await self._send(send, _body(item), watcher):
                    return True
            return True
        except OSError:  # the server noticed the hang-up on a write first
            return True
        finally:
            watcher.cancel()
            if not feeding.done():
                # Cancelled once: the producer's own clean-up (closing its events, cancelling
                # its task on NATS) must not be cancelled in turn. Waited for within a bound:
                # a producer inside a nats-py call may swallow the cancel; one left behind is
                # logged if it fails.
                feeding.cancel()
                await asyncio.wait({feeding}, timeout=CLOSE_WAIT_S)
                feeding.add_done_callback(log_failure)
            aclose = getattr(self.lines, "aclose", None)
            if aclose is not None and feeding.done():
                with contextlib.suppress(RuntimeError):  # still running: left behind
                    await aclose()

    async def _send(self, send: Send, message: Message, watcher: asyncio.Future[None]) -> bool:
        """Whether `message` went out within the send timeout and the client is still here.
        (A hang-up during a send ends it: uvicorn resumes a paused writer when the connection
        is lost, and its send then returns without writing.)"""
        sent, _ = await self._clock.within(self.send_timeout_s, send(message))
        return sent and (message.get("more_body", True) is False or not watcher.done())


AHEAD = 8  # chunks the producer may make before the client has taken them
_END = object()
_HUNG_UP = object()


class _Failed:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc


async def _feed(lines: AsyncIterator[bytes], ready: asyncio.Queue[Any]) -> None:
    """The producer's chunks into `ready`, then _END, or its failure (raised by the pump)."""
    try:
        async for chunk in lines:
            await ready.put(chunk)
    except Exception as exc:
        await ready.put(_Failed(exc))
        return
    await ready.put(_END)


async def _watch(receive: Receive, ready: asyncio.Queue[Any]) -> None:
    """The hang-up watcher: wakes a pump waiting for a chunk (one that is sending looks at
    the watcher itself)."""
    await hung_up(receive)
    with contextlib.suppress(asyncio.QueueFull):
        ready.put_nowait(_HUNG_UP)


class _Clock:
    """`within`: (True, what `waiting` gives), or (False, None) when `seconds` pass first (it
    is then cancelled). A timer and a flag, the task and loop looked up once: asyncio.timeout
    cost 24 us a use here (measured), and a stream waits twice a chunk."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.loop = asyncio.get_running_loop()
        self.expired = False

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel()

    async def within(self, seconds: float, waiting: Awaitable[R]) -> tuple[bool, R | None]:
        self.expired = False
        timer = self.loop.call_later(seconds, self._expire)
        try:
            return True, await waiting
        except asyncio.CancelledError:
            if self.expired and self.task.uncancel() == 0:  # our cancel, and no other
                return False, None
            raise
        finally:
            timer.cancel()


def _body(chunk: bytes) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": True}
