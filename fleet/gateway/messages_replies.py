"""Fleet events in, Anthropic Messages out: the `message` object, its SSE event sequence, the
count_tokens answer, and Anthropic's error shape. Pure functions of the events; no I/O.

The stream: message_start, ping, then per content block content_block_start, its deltas
(text_delta for text, one input_json_delta with the whole arguments for a tool call: Fleet's
runner emits a call when it is complete) and content_block_stop, then message_delta (the
stop_reason and the usage) and message_stop. A task that fails mid-stream ends with an `error`
event, as Anthropic's stream does.

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens the runner had to
prefill, `cache_read_input_tokens` those its prefix cache saved (their sum is the prompt).
The prompt's size is known when the task finishes, so message_start reports 0 input tokens
and message_delta the real counts (the SDKs take both from there).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError
from fleet.gateway.relay import sse
from fleet.gateway.text_replies import TextResult
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk, ToolCallChunk, Usage

# Anthropic's error type for each HTTP status; any other 4xx is an invalid request, any
# other 5xx an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_json(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; `code` keeps Fleet's own reason beside Anthropic's type."""
    error: dict[str, Any] = {"type": error_type(status), "message": message}
    if code:
        error["code"] = code
    return {"type": "error", "error": error}


def anthropic_error(status: int, body: bytes) -> bytes:
    """An error body in OpenAI's shape (every other route's) as Anthropic's. Pure."""
    try:
        error = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        error = {}
    message = error.get("message") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return orjson.dumps(error_json(status, message or body.decode(errors="replace") or
                                   f"HTTP {status}", code))


def usage_json(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage()
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finished: TaskFinished, has_tool_calls: bool) -> str:
    """end_turn, max_tokens, tool_use or stop_sequence (the runner names the stop string that
    ended the text on the finish event)."""
    if finished.finish_reason == "length":
        return "max_tokens"
    if has_tool_calls or finished.finish_reason == "tool_calls":
        return "tool_use"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; arguments that are not a JSON
    object are kept whole under `arguments` rather than lost."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def tool_use_block(call: ToolCallChunk, with_input: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": tool_input(call.arguments) if with_input else {}}


def message_json(
    message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
    usage: Usage | None, stop_sequence: str | None = None,
) -> dict[str, Any]:
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
        "usage": usage_json(usage),
    }


class MessagesRenderer:
    """A task's events as a Messages `message` or its SSE events (fleet.gateway.relay's
    Renderer). Content blocks are opened as they come: text, then each tool call."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.opened = False  # its opening was sent already (fleet.gateway.messages_stream)
        self.blocks = 0  # content blocks opened so far
        self.text_open = False
        self.tool_calls = 0

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        result = TextResult()
        for event in events:
            result.add(event)
        assert result.finished is not None
        content = [{"type": "text", "text": result.text}] if (
            result.text or not result.tool_calls) else []
        content += [tool_use_block(call) for call in result.tool_calls]
        reason = stop_reason(result.finished, bool(result.tool_calls))
        return message_json(self.message_id, self.model, content, reason, result.finished.usage,
                            result.finished.stop_sequence)

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, event=kind)

    def opening(self) -> list[bytes]:
        if self.opened:
            return []
        started = message_json(self.message_id, self.model, [], None, None)
        return [self._event("message_start", message=started), self._event("ping")]

    def _start(self, block: dict[str, Any]) -> bytes:
        self.blocks += 1
        return self._event("content_block_start", index=self.blocks - 1, content_block=block)

    def _stop_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        return [self._event("content_block_stop", index=self.blocks - 1)]

    async def lines(self, item: Indexed) -> list[bytes]:
        match item.event:
            case TokenChunk(text=text):
                lines = [] if self.text_open else [self._start({"type": "text", "text": ""})]
                self.text_open = True
                delta = {"type": "text_delta", "text": text}
                return [*lines, self._event("content_block_delta", index=self.blocks - 1,
                                            delta=delta)]
            case ToolCallChunk() as call:
                self.tool_calls += 1
                lines = [*self._stop_text(), self._start(tool_use_block(call, with_input=False))]
                delta = {"type": "input_json_delta", "partial_json": call.arguments or "{}"}
                return [*lines,
                        self._event("content_block_delta", index=self.blocks - 1, delta=delta),
                        self._event("content_block_stop", index=self.blocks - 1)]
            case TaskFinished() as finished:
                lines = self._stop_text()
                if self.blocks == 0:  # nothing was said: one empty text block, as Anthropic
                    lines += [self._start({"type": "text", "text": ""}),
                              self._event("content_block_stop", index=0)]
                delta = {"stop_reason": stop_reason(finished, self.tool_calls > 0),
                         "stop_sequence": finished.stop_sequence}
                return [*lines,
                        self._event("message_delta", delta=delta,
                                    usage=usage_json(finished.usage)),
                        self._event("message_stop")]
        return []

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        return [sse(error_json(exc.http_status, exc.message, exc.code), event="error")]


class TokenCountRenderer:
    """count_tokens: the prompt's size, as the runner's usage of a one-token task says."""

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        result = TextResult()
        for event in events:
            result.add(event)
        usage = result.finished.usage if result.finished else None
        return {"input_tokens": usage.prompt_tokens if usage else 0}

    def opening(self) -> list[bytes]:
        return []

    async def lines(self, item: Indexed) -> list[bytes]:
        return []

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        return []


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type for the HTTP status")
    message: str
    code: str | None = Field(default=None, description="Fleet's own reason")


class AnthropicErrorBody(BaseModel):
    """What every error on /v1/messages answers (the OpenAPI document names it)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
