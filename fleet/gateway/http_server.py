"""uvicorn's httptools protocol with the two limits uvicorn lacks.

- A header timeout: uvicorn times out idle keep-alive connections, but a connection that
  never finishes its request headers (a slow client, or one sending a byte a minute) is held
  forever. Here the headers must be complete `header_timeout_s` after the connection opens,
  or after a keep-alive request's first byte; then the connection is closed.
- A header size limit (64 KiB, then 431): httptools has none.
- A connection limit that answers 429: uvicorn's `limit_concurrency` answers 503, which
  reads as "the fleet is down". Over `max_connections` a new connection gets a 429 with
  Retry-After and is closed before anything of it is read.

The body's own timeout is the BodyTimeout middleware (fleet.gateway.guards).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

BUSY_BODY = b'{"error":{"message":"the gateway has too many open connections; retry later",' \
    b'"type":"rate_limit_error","param":null,"code":"too_many_connections"}}'
BUSY = (
    b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\nconnection: close\r\n"
    b"content-type: application/json\r\ncontent-length: " + str(len(BUSY_BODY)).encode()
    + b"\r\n\r\n" + BUSY_BODY
)


MAX_HEADER_BYTES = 64 * 1024
TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
    b"content-length: 0\r\n\r\n"
)


def protocol_class(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    class GatewayProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                transport.write(BUSY)
                transport.close()
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            self._header_bytes = 0
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                # debug: under a slowloris this would be a line per connection
                log.debug("closed a connection that sent no complete headers in %g s",
                          header_timeout_s)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self not in self.connections:
                return  # refused at connection_made
            super().data_received(data)
            if self._header_timer is not None and not self.transport.is_closing():
                # Still inside a request's headers: httptools itself sets no size limit.
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self.transport.write(TOO_LARGE)
                    self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self not in self.connections:
                return
            super().connection_lost(exc)

    return GatewayProtocol


def server_options(settings: Any) -> dict[str, Any]:
    """uvicorn.Config keywords for the gateway's limits (settings: fleet.config.Settings)."""
    return {
        "http": protocol_class(settings.gateway_header_timeout_s, settings.gateway_max_connections),
        "timeout_keep_alive": settings.gateway_keep_alive_s,
        # Past our own 429 limit, uvicorn's hard wall (it would answer 503): never reached first.
        "limit_concurrency": None,
    }
