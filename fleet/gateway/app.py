"""The gateway's process: the ASGI app (route table, middleware stack, error handlers) and
uvicorn's server with the limits it lacks. The `fleet gateway` command, and the packages
mounted on the app (the dashboard at /ui), are composed in fleet/commands/gateway.py: this
package never imports them.

uvicorn's httptools protocol has two limits added here:

- A header timeout: uvicorn times out idle keep-alive connections, but a connection that
  never finishes its request headers (a slow client, or one sending a byte a minute) is held
  forever. Here the headers must be complete `header_timeout_s` after the connection opens,
  or after a keep-alive request's first byte; then the connection is closed.
- A header size limit (64 KiB, then 431): httptools has none.
- A connection limit that answers 429: uvicorn's `limit_concurrency` answers 503, which
  reads as "the fleet is down". Over `max_connections` a new connection gets a 429 with
  Retry-After and is closed before anything of it is read.

The body's own timeout is the BodyTimeout middleware (fleet.gateway.bodies). The server is
uvicorn with uvloop and httptools.

`serve` is also what `fleet up` runs inside its own event loop, so it owns no signals: whoever
runs the loop stops the gateway by cancelling it, and the gateway then shuts down gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fleet import telemetry
from fleet.aio import CLOSE_WAIT_S, Supervisor
from fleet.bus.connect import redact_urls
from fleet.config import Settings
from fleet.errors import FleetError
from fleet.gateway import messages_api
from fleet.gateway.api_table import gateway_rows
from fleet.gateway.auth import ApiKeys
from fleet.gateway.backend import Backend
from fleet.gateway.batch_routes import batch_runner
from fleet.gateway.bodies import BodyLimit, BodyTimeout
from fleet.gateway.error_shapes import ErrorShapes
from fleet.gateway.errors import (
    on_client_disconnect,
    on_fleet_error,
    on_http_error,
    on_unexpected_error,
)
from fleet.gateway.keys import KeyRing
from fleet.gateway.messages_replies import anthropic_error
from fleet.gateway.observability import AccessLog, TraceOfItsOwn, http_spans
from fleet.gateway.ollama_errors import PATH as OLLAMA_PATH
from fleet.gateway.ollama_errors import ollama_error_body
from fleet.gateway.route_table import routes
from fleet.gateway.service import Gateway

log = logging.getLogger(__name__)


# Adds a package's routes to the app (the dashboard's `mount`); called before the outermost
# middleware is added, so that the access log and the HTTP spans see its routes too.
AddRoutes = Callable[[Starlette], None]
# What a mount starts with the app: appended to `app.state.lifespan_children`, called in the
# lifespan with its Supervisor, to which it adds its children (stopped with the app).
AddChildren = Callable[[Starlette, Supervisor], Awaitable[None]]


def build_app(settings: Settings, mounts: Iterable[AddRoutes] = ()) -> Starlette:
    ring = KeyRing.load(settings.api_keys, settings.api_keys_file)
    gateway = Gateway(settings, Backend(settings))
    batches = batch_runner(gateway, ring.policy)  # a job's lines weigh as its tenant

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # One owner for the gateway's long-lived tasks: the NATS connect loop, the refills,
        # the catalogue's watches, the batch scanner and jobs, and what mounts add
        # (`app.state.lifespan_children`: the dashboard's feed). A TaskGroup is left by the
        # task that entered it: uvicorn runs the lifespan as one task (LifespanOn.main
        # awaits the app, whose router does `async with lifespan_context(app)` and then
        # `await receive()` until shutdown), and so do
        # Starlette's TestClient (one portal task) and asgi-lifespan's LifespanManager (one
        # background task); httpx's ASGITransport runs no lifespan. The suite's fixtures that
        # enter it in a fixture's setup and leave it in its teardown use two tasks: that works
        # because no child raises out of the group (each is `spawn`ed or `forever`, failures
        # logged), so the group never cancels the task that entered it.
        async with Supervisor("gateway", bounded_s=CLOSE_WAIT_S) as owner:
            try:
                await gateway.backend.start(owner)
                await gateway.catalogue.start(
                    owner, wait_s=2.0 if gateway.backend.connected else 0.0)
                await batches.start(owner)
                for add_children in app.state.lifespan_children:
                    await add_children(app, owner)
                yield
            finally:
                await batches.close()
                # Bounded: a child inside a nats-py call may swallow its cancel (each gets
                # CLOSE_WAIT_S, then is left behind, logged).
                await owner.cancel_all()
                await gateway.backend.close()
                gateway.metrics.meters.shutdown()

    app = Starlette(
        # Every route, declared once as data (fleet/gateway/api_table.py): the same rows make
        # /openapi.json.
        routes=routes(gateway_rows()),
        middleware=[
            Middleware(ApiKeys, ring=ring, protect_metrics=settings.gateway_protect_metrics),
            Middleware(BodyTimeout, seconds=settings.gateway_body_timeout_s),
            Middleware(BodyLimit, max_bytes=settings.gateway_max_body_bytes),
        ],
        exception_handlers={
            ClientDisconnect: on_client_disconnect,
            FleetError: on_fleet_error,
            HTTPException: on_http_error,
            Exception: on_unexpected_error,
        },
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.batches = batches  # /v1/files, /v1/batches and the jobs this gateway runs
    app.state.key_ring = ring  # the dashboard asks it who is an operator
    # What a mount starts with the app, as children of the lifespan's Supervisor.
    app.state.lifespan_children = []
    for mount in mounts:
        mount(app)  # /ui: fleet/dashboard, mounted by fleet/commands/gateway.py
    # Outside the key check and the body limits: their refusals on /v1/messages too are in
    # Anthropic's shape.
    app.add_middleware(ErrorShapes, path=messages_api.PATH, reshape=anthropic_error)
    app.add_middleware(ErrorShapes, path=OLLAMA_PATH,  # the same for /api/, in Ollama's shape
                       reshape=ollama_error_body)
    # Outermost, in this order: the access log sees every request; each request starts with
    # no trace context; the HTTP span is current for everything below it. Added last so that
    # they know every route, /ui's too.
    meter_provider = gateway.metrics.meters.provider
    app.add_middleware(http_spans, routes=app.router.routes, meter_provider=meter_provider)
    app.add_middleware(TraceOfItsOwn)
    app.add_middleware(AccessLog)
    telemetry.export_to_nats(lambda: gateway.backend.nc)
    return app


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


# Open streams get this long to finish when the gateway stops; then they are cut.
GRACEFUL_SHUTDOWN_S = 5


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts: from here on connections queue, not fail."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FleetError(
            f"the gateway cannot listen on {host}:{port}: {exc.strerror}; pass --port N "
            "or set FLEET_GATEWAY_PORT"
        ) from None
    sock.listen(2048)
    return sock


async def serve(
    settings: Settings, ready: asyncio.Event | None = None, sock: socket.socket | None = None,
    mounts: Iterable[AddRoutes] = (),
) -> None:
    """Serve until cancelled, on `sock` when given (bound by the caller before it started
    anything else: `fleet up` fails on a taken port before NATS and the worker start)."""
    import uvicorn

    from fleet.gateway.app import build_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the loop's owner handles signals and cancels us

    sock = sock or listening_socket(settings.gateway_host, settings.gateway_port)
    host, port = sock.getsockname()[:2]
    log.info(
        "gateway listening on http://%s:%d/v1 (NATS %s)", host, port, redact_urls(settings.urls)
    )
    config = uvicorn.Config(
        build_app(settings, mounts),
        log_level=settings.log_level.lower(),
        # The AccessLog middleware (fleet/gateway/observability.py) writes the one line per request.
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **server_options(settings),
    )
    server = Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    if ready is not None:
        ready.set()
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        # Streams get their grace; a lifespan stuck on a broker that is down gets no more.
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(serving, GRACEFUL_SHUTDOWN_S + 1)
        raise
    finally:
        sock.close()
