"""Every failure in OpenAI's error shape: the body, the HTTP handlers, the 400 that
names a parameter, and the error a task's terminal event stands for.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import (
    FleetError,
    InvalidRequest,
    NatsUnavailable,
    PayloadTooLarge,
    TaskFailed,
    Unauthorized,
)
from fleet.gateway.observability import GatewayMetrics
from fleet.wire.events import (
    ErrorReason,
)

log = logging.getLogger(__name__)


# Errors without a wire reason of their own still get a code a client can branch on.
_CODE_BY_TYPE = {
    Unauthorized: "invalid_api_key",
    PayloadTooLarge: "payload_too_large",
    NatsUnavailable: "nats_unavailable",
}


# A worker's failure has only a reason; the status it maps to picks OpenAI's error type.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    504: "timeout",
}


def error_body(exc: FleetError) -> dict[str, Any]:
    """OpenAI's error shape; `code` is Fleet's wire reason where the error has one."""
    code = getattr(exc, "code", None) or _CODE_BY_TYPE.get(type(exc))
    if code is None and (isinstance(exc, TaskFailed) or exc.reason is not ErrorReason.INTERNAL):
        code = exc.reason.value
    kind = exc.openai_type
    if isinstance(exc, TaskFailed):
        kind = _TYPE_BY_STATUS.get(exc.http_status, "server_error")
    error = {"message": exc.message, "type": kind, "param": getattr(exc, "param", None)}
    return {"error": {**error, "code": code}}


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


def counted_error_response(metrics: GatewayMetrics, exc: FleetError) -> JSONResponse:
    """The error's response, counted in /metrics by its code."""
    metrics.error(error_body(exc)["error"]["code"] or str(exc.http_status))
    return error_response(exc)


async def on_fleet_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FleetError)
    return counted_error_response(request.app.state.gateway.metrics, exc)


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


class InvalidParameter(InvalidRequest):
    """A 400 that names the offending request parameter, as OpenAI's `param` does."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


# pydantic puts the union member it tried into an error's location ("stop.str"); a client
# wants the parameter, so the path stops where those tags begin.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})


def _param(location: tuple[int | str, ...]) -> str | None:
    kept: list[str] = []
    for part in location:
        if isinstance(part, str) and (not part.isidentifier() or part in _UNION_TAGS):
            break
        kept.append(str(part))
    return ".".join(kept) or None


def invalid_from(error: ValidationError) -> InvalidParameter:
    """The first problem of a validation error, in words, naming the parameter."""
    item = error.errors()[0]
    param = _param(item["loc"])
    return InvalidParameter(f"{param}: {item['msg']}" if param else item["msg"], param)


def not_found(task_id: str) -> HttpError:
    # The same words for another tenant's task and a missing one: nothing confirms an id.
    return HttpError(404, f"no task {task_id} is known here: unknown or expired")
