"""POST /v1/responses, OpenAI's Responses API for text: the request as a chat request, and a
task's events as a `response` object or its SSE event sequence. Pure: no I/O, no clock.

What is served: `input` as a string or a list of messages (text and image parts),
`instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`,
`text.format` (text, json_object, json_schema: enforced like chat's `response_format`),
streaming or not. Fleet keeps no conversation state, so `previous_response_id` (and `store`'d
retrieval) is refused, as are tools; a response is one task, its id the response's id.

The stream: response.created, response.in_progress, response.output_item.added,
response.content_part.added, one response.output_text.delta per token,
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed (or response.incomplete when max_output_tokens cut it; response.failed,
with the error and the text so far, when the task failed mid-stream), each with its
`sequence_number`; no `[DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema

from fleet.bus.task_events import Indexed
from fleet.errors import FleetError, InvalidParameter
from fleet.gateway.bodies import OpenAIRequest, Timeout
from fleet.gateway.errors import error_body, invalid_from
from fleet.gateway.relay import sse
from fleet.gateway.text_replies import TextResult
from fleet.gateway.text_requests import (
    ChatCompletionRequest,
    ImageContent,
    ImageURL,
    JsonSchemaIn,
    MessageIn,
    ResponseFormatIn,
    SchemaName,
    TextContent,
)
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk, Usage


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(OpenAIRequest):
    type: Literal["input_image"]
    image_url: str = Field(description="A data: URL or this gateway's image URL")


InputPart = InputText | InputImage


class InputMessage(OpenAIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class TextFormatIn(OpenAIRequest):
    """`text.format`: the Responses spelling of chat's response_format (name and schema flat)."""

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["schema"], "properties": {"schema": {"type": "object"}}},
    })

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: SchemaName | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfigIn(OpenAIRequest):
    format: TextFormatIn = Field(default_factory=TextFormatIn)


class ResponsesRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=131072)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfigIn | None = None
    # Refused with a reason when given (below); the document says what is served.
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(
        {"type": "array", "maxItems": 0, "description": "Not served: use chat completions"}
    )] = None
    previous_response_id: Annotated[str | None, WithJsonSchema(
        {"type": "null", "description": "Not served: Fleet keeps no conversation state"}
    )] = None
    timeout: Timeout | None = None
    resumable: bool = Field(
        default=False,
        description="Fleet: a dropped stream does not cancel the task; resume it from "
        "/v1/tasks/{id}/events",
    )


def _content(content: str | list[InputPart]) -> str | list[TextContent | ImageContent]:
    if isinstance(content, str):
        return content
    return [
        TextContent(type="text", text=part.text) if isinstance(part, InputText)
        else ImageContent(type="image_url", image_url=ImageURL(url=part.image_url))
        for part in content
    ]


def _response_format(text: TextConfigIn | None) -> ResponseFormatIn | None:
    wanted = text.format if text else None
    if wanted is None or wanted.type == "text":
        return None
    if wanted.type == "json_object":
        return ResponseFormatIn(type="json_object")
    if wanted.schema_ is None:
        raise InvalidParameter("text.format: type json_schema needs a schema", "text.format")
    schema = JsonSchemaIn(name=wanted.name or "response", schema=wanted.schema_,
                          strict=wanted.strict)
    return ResponseFormatIn(type="json_schema", json_schema=schema)


def as_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for; what Fleet cannot serve is a 400."""
    if request.previous_response_id is not None:
        raise InvalidParameter(
            "previous_response_id: Fleet keeps no conversation state; send the whole "
            "conversation as `input` messages", "previous_response_id",
        )
    if request.tools:
        raise InvalidParameter(
            "tools: /v1/responses serves text only; use /v1/chat/completions for tools",
            "tools",
        )
    messages = [MessageIn(role="system", content=request.instructions)] if (
        request.instructions) else []
    if isinstance(request.input, str):
        messages.append(MessageIn(role="user", content=request.input))
    else:
        messages += [MessageIn(role=m.role, content=_content(m.content)) for m in request.input]
    try:
        return ChatCompletionRequest(
            model=request.model, messages=messages, stream=request.stream,
            max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, response_format=_response_format(request.text),
            timeout=request.timeout, resumable=request.resumable,
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None


def usage_object(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass(frozen=True)
class ResponseShape:
    """What every form of one response shares: the envelope of the `response` object."""

    response_id: str
    model: str
    created_at: int
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})

    @property
    def item_id(self) -> str:
        return f"msg-{self.response_id}"

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
        incomplete: str | None = None, error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": self.text_format}, "tool_choice": "auto", "tools": [],
            "truncation": "disabled", "usage": usage, "user": None, "metadata": {},
        }

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": parts}

    def finished(self, text: str, finished: TaskFinished) -> dict[str, Any]:
        """The whole response of a completed task."""
        cut = finished.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        output = [self.message(status, [self.part(text)])]
        return self.response(status, output, usage_object(finished.usage),
                             "max_output_tokens" if cut else None)


def shape_of(request: ResponsesRequest, response_id: str, created_at: int) -> ResponseShape:
    text_format: dict[str, Any] = {"type": "text"}
    if request.text is not None:
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True)
    return ResponseShape(
        response_id, request.model, created_at, request.instructions,
        request.max_output_tokens, request.temperature, request.top_p, text_format,
    )


class ResponsesRenderer:
    """A task's events as the Responses API's body or SSE events (fleet.gateway.text_replies'
    Renderer): every event is numbered by `sequence_number`, its SSE `event:` is its type."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.text = ""

    def _event(self, kind: str, event_id: int | None = None, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, event=kind, event_id=event_id)

    async def body(self, events: list[OutputEvent]) -> dict[str, Any]:
        result = TextResult()
        for event in events:
            result.add(event)
        assert result.finished is not None
        return self.shape.finished(result.text, result.finished)

    def opening(self) -> list[bytes]:
        shape, at = self.shape, {"output_index": 0}
        started = shape.response("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event("response.output_item.added", **at,
                        item=shape.message("in_progress", [])),
            self._event("response.content_part.added", **at, item_id=shape.item_id,
                        content_index=0, part=shape.part("")),
        ]

    async def lines(self, item: Indexed) -> list[bytes]:
        shape, at = self.shape, {"output_index": 0, "item_id": self.shape.item_id}
        match item.event:
            case TokenChunk(text=text):
                self.text += text
                return [self._event("response.output_text.delta", item.index, **at,
                                    content_index=0, delta=text, logprobs=[])]
            case TaskFinished() as finished:
                whole = shape.finished(self.text, finished)
                [message] = whole["output"]
                done = "response.incomplete" if whole["status"] == "incomplete" else (
                    "response.completed")
                return [
                    self._event("response.output_text.done", **at, content_index=0,
                                text=self.text, logprobs=[]),
                    self._event("response.content_part.done", **at, content_index=0,
                                part=shape.part(self.text)),
                    self._event("response.output_item.done", output_index=0, item=message),
                    self._event(done, item.index, response=whole),
                ]
        return []

    def closing(self) -> list[bytes]:
        return []

    def failed(self, exc: FleetError) -> list[bytes]:
        """response.failed, as the Responses API ends a stream whose response failed: the
        response with status failed, its error, and the text made so far."""
        error = error_body(exc)["error"]
        output = [self.shape.message("incomplete", [self.shape.part(self.text)])]
        whole = self.shape.response("failed", output if self.text else [], error={
            "code": error["code"] or "server_error", "message": error["message"]})
        return [self._event("response.failed", response=whole)]
