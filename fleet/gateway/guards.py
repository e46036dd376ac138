"""What stands between a request and a route: the body cap and read timeout, API keys and
their tenants, JSON parsing, and the translation of every failure into
OpenAI's error shape.

The middlewares are plain ASGI so that a body over the cap is refused while it streams in,
not after it has been buffered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.errors import FleetError, InvalidRequest, PayloadTooLarge, Unauthorized
from fleet.gateway import docs
from fleet.gateway.metrics import GatewayMetrics
from fleet.gateway.openai import invalid_from
from fleet.gateway.replies import error_body
from fleet.gateway.tenants import KeyRing

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

# Open to anyone: /healthz then answers only up or not; a key shows its details.
PROBE_PATHS = frozenset({"/healthz", "/health", "/openapi.json"})
CLIENT_CLOSED_REQUEST = 499


def error_response(exc: FleetError) -> JSONResponse:
    response = JSONResponse(error_body(exc), status_code=exc.http_status)
    if (retry_after := getattr(exc, "retry_after_s", None)) is not None:
        response.headers["retry-after"] = str(retry_after)
    if exc.http_status == 408:  # the rest of the body may still be on its way: start afresh
        response.headers["connection"] = "close"
    return response


class RequestTimeout(FleetError):
    http_status = 408
    openai_type = "invalid_request_error"
    code = "request_timeout"


class HttpError(FleetError):
    """A routing failure (no such path, wrong method) in OpenAI's error shape."""

    openai_type = "invalid_request_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.code = {404: "not_found", 405: "method_not_allowed"}.get(status)


async def on_fleet_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FleetError)
    metrics: GatewayMetrics = request.app.state.gateway.metrics
    metrics.error(error_body(exc)["error"]["code"] or str(exc.http_status))
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = error_response(HttpError(exc.status_code, exc.detail or "error"))
    response.headers.update(exc.headers or {})  # e.g. Allow on a 405
    return response


async def on_client_disconnect(request: Request, exc: Exception) -> Response:
    """A client that hangs up mid-request is one line in the log, not a traceback."""
    log.info("client hung up during %s %s", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def on_unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(FleetError(f"internal error: {type(exc).__name__}"))


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_from(exc) from None


def _refuse(exc: FleetError) -> ASGIApp:
    response = error_response(exc)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return app


class BodyLimit:
    """413 for a declared Content-Length over the cap, and for a body that grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = PayloadTooLarge(f"the request body is over {self.max_bytes} bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await _refuse(too_large)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, counted, send)


class BodyTimeout:
    """408 for a request whose body takes longer than `seconds` to arrive (a slow client
    holding a connection and a buffer); once the body is in, `receive` is left alone."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.seconds
        complete = False

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.seconds:g} s"
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, timed, send)


def tenant_of(request: Request) -> str | None:
    """The tenant of the request's key; None on an open gateway (no keys configured)."""
    return request.scope.get("state", {}).get("tenant")


def authenticated(request: Request) -> bool:
    """A valid key was sent, or no keys are configured (then everyone is trusted)."""
    return bool(request.scope.get("state", {}).get("authenticated"))


class ApiKeys:
    """Bearer keys on every route but the probes when keys are configured; each key's
    tenant goes into the request's state for the routes to scope what they answer."""

    def __init__(self, app: ASGIApp, ring: KeyRing, protect_metrics: bool = False) -> None:
        self.app = app
        self.ring = ring
        self.open_paths = PROBE_PATHS if protect_metrics else PROBE_PATHS | {"/metrics"}

    def _tenant(self, scope: Scope) -> str | None:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self.ring.tenant_of(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if self.ring.open:
            state.update(tenant=None, authenticated=True)
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        state.update(tenant=tenant, authenticated=tenant is not None)
        path = scope["path"]
        if tenant is None and path not in self.open_paths and not docs.is_open(path):
            refusal = Unauthorized("a valid API key is required: Authorization: Bearer KEY")
            return await _refuse(refusal)(scope, receive, send)
        await self.app(scope, receive, send)

