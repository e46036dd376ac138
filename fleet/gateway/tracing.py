"""HTTP server spans: ASGI middleware making `<METHOD> <route>` (SERVER) for every request.

The span is the root of the request's trace unless the client sent a `traceparent`, whose
trace it then joins. It is current while the app runs, so the task the request publishes is
its child (`send fleet.tasks.<model>`), and it ends when the response's last byte is sent.
Health checks and metric scrapes are left out: they would be a trace each, every few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import telemetry

UNTRACED_PATHS = frozenset({"/healthz", "/metrics"})
# One line per request: `<client> "<METHOD> <path>" <status> <ms> ms task=<id>` (health checks
# and scrapes at debug). The task id comes from the response's x-fleet-task-id header.
access_log = logging.getLogger("fleet.gateway.access")


def access_line(scope: Scope, status: int, elapsed_s: float, task_id: str) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{who} "{scope["method"]} {scope["path"]}" {status or "-"} {elapsed_s * 1000:.1f} ms'
    return line + (f" task={task_id}" if task_id else "")


def header_of(message: Message, name: bytes) -> str:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def request_attributes(scope: Scope) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
    }
    if scope.get("query_string"):
        attributes["url.query"] = scope["query_string"].decode("latin-1")
    if server := scope.get("server"):
        attributes["server.address"], attributes["server.port"] = server[0], server[1]
    if client := scope.get("client"):
        attributes["client.address"] = client[0]
    for name, value in scope.get("headers", ()):
        if name == b"user-agent":
            attributes["user_agent.original"] = value.decode("latin-1")
    return attributes


def trace_headers(scope: Scope) -> dict[str, str]:
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope.get("headers", ())
        if name in (b"traceparent", b"tracestate")
    }


class HttpSpans:
    def __init__(self, app: ASGIApp, nats: Callable[[], Client | None]) -> None:
        """`nats()`: the gateway's connection (None until it is up), for the span exporter."""
        self.app = app
        self.tracer = trace.get_tracer("fleet.gateway")
        telemetry.export_to_nats(nats)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_code = 0
        task_id = ""
        started = time.perf_counter()

        async def send_noting_status(message: Message) -> None:
            nonlocal status_code, task_id
            if message["type"] == "http.response.start":
                status_code = message["status"]
                task_id = header_of(message, b"x-fleet-task-id")
            await send(message)

        try:
            if scope["path"] in UNTRACED_PATHS:
                await self.app(scope, receive, send_noting_status)
            else:
                await self._traced(scope, receive, send_noting_status, lambda: status_code)
        finally:
            level = logging.DEBUG if scope["path"] in UNTRACED_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s", access_line(
                    scope, status_code, time.perf_counter() - started, task_id))

    async def _traced(
        self, scope: Scope, receive: Receive, send: Send, status: Callable[[], int]
    ) -> None:

        with self.tracer.start_as_current_span(
            scope["method"],
            context=telemetry.extract_context(trace_headers(scope)),
            kind=SpanKind.SERVER,
            attributes=request_attributes(scope),
        ) as span:
            try:
                await self.app(scope, receive, send)
            finally:
                status_code = status()
                # The router wrote the matched route into this scope on the way down.
                if route := getattr(scope.get("route"), "path", None):
                    span.update_name(f"{scope['method']} {route}")
                    span.set_attribute("http.route", route)
                if status_code:
                    span.set_attribute("http.response.status_code", status_code)
                    if status_code >= 500:
                        span.set_status(Status(StatusCode.ERROR))
