"""Every failure in OpenAI's error shape: the body, the HTTP handlers, and the 400 that names a
parameter. Statuses and OpenAI types come from the one table, fleet.errors.STATUS_BY_CODE.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import FleetError, HttpError, InvalidParameter
from fleet.gateway.observability import GatewayMetrics

log = logging.getLogger(__name__)


# Where OpenAI has a code of its own that client libraries look for (LangChain, LiteLLM and
# the agents SDKs test `code == "context_length_exceeded"` to trim a conversation), the body
# carries OpenAI's code, the request field it concerns, and Fleet's own code as `fleet_code`.
OPENAI_CODES = {"context_length": "context_length_exceeded"}


# The request field that holds the prompt: `messages` for a chat, set by the routes whose
# prompt is elsewhere (`prompt` for completions, `input` for responses). A context variable
# so that the relay's error answers, made deep inside a request, name the request's field.
PROMPT_PARAM: ContextVar[str] = ContextVar("prompt_param", default="messages")


def error_body(exc: FleetError) -> dict[str, Any]:
    """OpenAI's error shape; `code` is the error's code (its wire reason where it has one),
    `type` the OpenAI type the one table (fleet.errors.STATUS_BY_CODE) gives that code."""
    param = getattr(exc, "param", None)
    error: dict[str, Any] = {"message": exc.message, "type": exc.openai_type, "param": param}
    if openai_code := OPENAI_CODES.get(exc.code):
        return {"error": {**error, "param": param or PROMPT_PARAM.get(), "code": openai_code,
                          "fleet_code": exc.code}}
    return {"error": {**error, "code": exc.code}}


CLIENT_CLOSED_REQUEST = 499
# Every 429 says when to come back; a model's full queue frees a place as any task ends.
RETRY_AFTER_S = 1


def error_response(exc: FleetError) -> JSONResponse:
    response = JSONResponse(error_body(exc), status_code=exc.http_status)
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is None and exc.http_status == 429:
        retry_after = RETRY_AFTER_S
    if retry_after is not None:
        response.headers["retry-after"] = str(retry_after)
    if exc.http_status == 408:  # the rest of the body may still be on its way: start afresh
        response.headers["connection"] = "close"
    return response


def counted_error_response(metrics: GatewayMetrics, exc: FleetError) -> JSONResponse:
    """The error's response, counted in /metrics by its code."""
    metrics.error(exc.code)
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
