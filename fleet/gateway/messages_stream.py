"""A Messages stream committed before its first token, with pings while the prompt prefills.

The relay commits a stream (sends its headers) with the task's first token, so that a failure
before it is a proper HTTP error. A long prompt on a small machine can take minutes to
prefill (Claude Code's is ~50k tokens), and Anthropic's clients give up on a connection that
stays silent that long. So a Messages stream whose request has not been answered after
`EARLY_COMMIT_S` is committed here: 200, `message_start` and `ping` at once, a `ping` every
`PING_S` until the relay's stream is ready, then that stream's lines (its own opening left
out). A failure after the commit arrives as an `error` event in Anthropic's shape, as
Anthropic's own streams report an overload. Short requests never get here: they keep their
exact HTTP statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from fleet.errors import FleetError
from fleet.gateway.errors import CLIENT_CLOSED_REQUEST
from fleet.gateway.messages_replies import MessagesRenderer, anthropic_error, error_json
from fleet.gateway.relay import EventStream, sse

log = logging.getLogger(__name__)

EARLY_COMMIT_S = 2.0
PING_S = 10.0


class EarlyStream:
    """An ASGI response over `running` (the request's gateway.run), owned from here on: it is
    awaited, and the stream it gives is run or closed, whatever the client does."""

    def __init__(
        self, running: asyncio.Future[Response], renderer: MessagesRenderer,
        headers: dict[str, str],
    ) -> None:
        self.running = running
        self.renderer = renderer
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {"content-type": "text/event-stream; charset=utf-8",
                   "cache-control": "no-cache", "x-accel-buffering": "no", **self.headers}
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
            await self._body(send, b"".join(self.renderer.opening()))
            self.renderer.opened = True  # the relay's stream starts without its opening
            while not self.running.done():
                done, _ = await asyncio.wait({self.running}, timeout=PING_S)
                if not done:
                    await self._body(send, sse({"type": "ping"}, event="ping"))
        except BaseException:
            await self._abandon()
            raise
        await self._finish(scope, receive, send)

    async def _finish(self, scope: Scope, receive: Receive, send: Send) -> None:
        ending = b""
        try:
            response = self.running.result()
        except FleetError as exc:
            ending = sse(error_json(exc.http_status, exc.message, exc.code), event="error")
        except Exception as exc:
            log.exception("a Messages stream failed before its first token")
            ending = sse(error_json(500, f"internal error: {type(exc).__name__}"), event="error")
        else:
            if isinstance(response, EventStream):
                await response(scope, receive, _without_start(send))
                return
            ending = _error_event(response)  # answered, not streamed: an error, or a 499
        await send({"type": "http.response.body", "body": ending, "more_body": False})

    async def _abandon(self) -> None:
        """The client left (or the server stops) before the stream was handed on: the task's
        stream is closed as a hang-up, so its task is cancelled and its place given back."""
        if not self.running.done():
            self.running.cancel()
        with contextlib.suppress(BaseException):
            response = await self.running
            if isinstance(response, EventStream):
                await response.on_close(True)

    @staticmethod
    async def _body(send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": True})


def _error_event(response: Response) -> bytes:
    if response.status_code < 400 or response.status_code == CLIENT_CLOSED_REQUEST:
        return b""
    body = anthropic_error(response.status_code, bytes(response.body))
    return b"event: error\ndata: " + body + b"\n\n"


def _without_start(send: Send) -> Send:
    async def forward(message: Message) -> None:
        if message["type"] != "http.response.start":
            await send(message)

    return forward
