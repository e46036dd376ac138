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
from collections.abc import AsyncIterator

from starlette.responses import Response

from fleet.errors import FleetError
from fleet.gateway.errors import CLIENT_CLOSED_REQUEST
from fleet.gateway.messages_replies import MessagesRenderer, anthropic_error, error_json
from fleet.gateway.sse import EventStream, sse

log = logging.getLogger(__name__)

EARLY_COMMIT_S = 2.0
PING_S = 10.0
PING = sse({"type": "ping"}, event="ping")  # Anthropic's keep-alive, for the kit to send


class EarlyStream(EventStream):
    """An SSE response (fleet.gateway.sse) over `running` (the request's gateway.run), owned
    from here on: it is awaited, and the stream it gives is relayed and closed, whatever the
    client does. The kit sends the pings while `running` is not done, and its hang-up watcher
    cancels `running` (the request's task with it) when the client leaves first."""

    def __init__(
        self, running: asyncio.Future[Response], renderer: MessagesRenderer,
        headers: dict[str, str],
    ) -> None:
        self.running = running
        self.renderer = renderer
        self.relayed: EventStream | None = None
        super().__init__(self._lines(), self._closed, keepalive=PING, keepalive_s=PING_S,
                         headers=headers)

    async def _lines(self) -> AsyncIterator[bytes]:
        yield b"".join(self.renderer.opening())
        self.renderer.opened = True  # the relay's stream starts without its opening
        try:
            # Shielded: when the client leaves, `_closed` cancels it, once (a second cancel
            # would cut short its clean-up: closing its events, cancelling its task).
            response = await asyncio.shield(self.running)
        except FleetError as exc:
            yield sse(error_json(exc.http_status, exc.message, exc.code), event="error")
            return
        except Exception as exc:
            log.exception("a Messages stream failed before its first token")
            yield sse(error_json(500, f"internal error: {type(exc).__name__}"), event="error")
            return
        if not isinstance(response, EventStream):
            if ending := _error_event(response):  # answered, not streamed: an error, or a 499
                yield ending
            return
        self.relayed = response
        async for chunk in response.lines:
            yield chunk

    async def _closed(self, hung_up: bool) -> None:
        if self.relayed is not None:
            with contextlib.suppress(RuntimeError):  # a producer left running: its close
                await self.relayed.lines.aclose()  # type: ignore[attr-defined]
            if self.relayed.on_close is not None:
                await self.relayed.on_close(hung_up)
            return
        # The client left (or the server stops) before the stream was handed on: the task's
        # stream is closed as a hang-up, so its task is cancelled and its place given back.
        # After a hang-up the relay, which watches for it too, ends by itself and cancels
        # what it published (cancelled from here, it could be cut inside a publish that
        # stored its task); a stopping server cancels it.
        if not hung_up and not self.running.done():
            self.running.cancel()
        with contextlib.suppress(BaseException):
            response = await self.running
            if isinstance(response, EventStream) and response.on_close is not None:
                await response.on_close(True)


def _error_event(response: Response) -> bytes:
    if response.status_code < 400 or response.status_code == CLIENT_CLOSED_REQUEST:
        return b""
    body = anthropic_error(response.status_code, bytes(response.body))
    return b"event: error\ndata: " + body + b"\n\n"
