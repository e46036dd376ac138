"""HTTP server spans and metrics from OpenTelemetry's ASGI instrumentation, and the one
access-log line per request.

The span (`<METHOD> <route>`, SERVER) is the root of the request's trace unless the client
sent a `traceparent`, whose trace it then joins. It is current while the app runs, so the task
the request publishes is its child (`send fleet.tasks.<model>`), and it ends when the
response's last byte is sent. The same middleware records http.server.request.duration and
http.server.active_requests on the gateway's meter provider. Health checks, metric scrapes and
the dashboard's static files are left out of both: they would be a trace each, every few
seconds.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.metrics import MeterProvider
from opentelemetry.util.http import ExcludeList
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Probes, scrapes and the dashboard's static files: no span, and their access lines at debug.
_UNTRACED = r"/(?:healthz|health|metrics|ui/static/.*|docs/static/.*)"
UNTRACED_PATH = re.compile(_UNTRACED)
# The instrumentation matches against the whole URL (scheme, host, path).
UNTRACED_URLS = ExcludeList([rf"^[a-z]+://[^/]*{_UNTRACED}$"])
# One line per request: `<client> "<METHOD> <path>" <status> <ms> ms task=<id>` (health checks
# and scrapes at debug). The task id comes from the response's x-fleet-task-id header.
access_log = logging.getLogger("fleet.gateway.access")


def http_spans(
    app: ASGIApp, routes: Sequence[BaseRoute], meter_provider: MeterProvider
) -> ASGIApp:
    """`app` inside the ASGI instrumentation, with spans named by route template."""
    # The instrumentation writes the stable HTTP conventions (http.request.method,
    # http.response.status_code, seconds) only when opted in; it reads this once.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")

    def span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
        method = scope.get("method", "HTTP")
        route = route_of(routes, scope)
        return (f"{method} {route}", {"http.route": route}) if route else (method, {})

    return OpenTelemetryMiddleware(
        app,
        excluded_urls=UNTRACED_URLS,
        default_span_details=span_details,
        meter_provider=meter_provider,
        # A span per receive and send would be one per streamed token.
        exclude_spans=["receive", "send"],
    )


def route_of(routes: Sequence[BaseRoute], scope: Scope) -> str | None:
    """The template of the route that will serve `scope`, matched as Starlette's router
    matches (the first full match, else the first that matches all but the method: its 405),
    so the span is named, and its duration recorded, by template from the start: a path with
    a task id or an image hash in it would be a metric series of its own."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path_format", None)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path_format", None)
    return partial


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


class AccessLog:
    """The access-log line of each request, written when the app is done with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            await self.app(scope, receive, send_noting_status)
        finally:
            level = logging.DEBUG if UNTRACED_PATH.fullmatch(scope["path"]) else logging.INFO
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s", access_line(
                    scope, status_code, time.perf_counter() - started, task_id))
