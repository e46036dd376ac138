"""Ollama's requests in, Fleet tasks out: /api/chat and /api/generate as the same text tasks
the OpenAI routes make. Pure: no I/O, no clock.

Ollama's names map onto the task's: `options.num_predict` is `max_tokens` (-1, -2 or absent:
until the model stops or the context is full, as Ollama does), `repeat_penalty` is
`repetition_penalty`, `format` ("json" or a JSON Schema) the structured-output grammar the
OpenAI routes use for `response_format`. Options Fleet has no use for (num_ctx, num_gpu,
mirostat…) are ignored, as Ollama ignores those a runner lacks. `/api/generate` without `raw`
applies the model's chat template to its prompt, as Ollama does, so it becomes a chat task
(system, then the prompt as the user's turn); with `raw` the prompt is the model's text as
it is. Images arrive as bare base64 and go where the OpenAI routes put data URLs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, ValidationError, model_validator

from fleet.errors import InvalidParameter
from fleet.gateway.bodies import OpenAIRequest, Seed, deadline_after
from fleet.gateway.embeddings_api import MAX_DIMENSIONS
from fleet.gateway.errors import invalid_from
from fleet.gateway.text_requests import ToolIn
from fleet.grammar import grammar_for
from fleet.wire.tasks import ResponseFormat, TextGeneration


class OllamaOptions(OpenAIRequest):
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    num_predict: int | None = Field(
        default=None, ge=-2, le=131072,
        description="Tokens to make at most; -1, -2 or absent: until the model stops or the "
        "context is full",
    )
    stop: Annotated[list[str], Field(max_length=8)] | None = None
    seed: Seed | None = None
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)


Format = Literal["", "json"] | dict[str, Any]


class _OllamaRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    stream: bool = Field(default=True, description="NDJSON lines as tokens come (Ollama's "
                         "default); false: one JSON object at the end")
    options: OllamaOptions | None = None
    format: Format | None = Field(
        default=None, description='"json", or a JSON Schema the reply must match'
    )
    keep_alive: float | str | None = Field(
        default=None, description="Ignored: Fleet keeps a model placed until it is removed"
    )


class OllamaFunctionCall(OpenAIRequest):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(OpenAIRequest):
    function: OllamaFunctionCall


class OllamaMessage(OpenAIRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(default=None, description="Base64 images (no data: URL)")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(default=None, description="A tool message: its tool")


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(
        default_factory=list, description="Empty: only load the model (done_reason load)"
    )
    tools: list[ToolIn] | None = None


class OllamaGenerateRequest(_OllamaRequest):
    prompt: str = Field(default="", description="Empty: only load the model (done_reason "
                        "load)")
    system: str | None = None
    raw: bool = Field(default=False, description="The prompt as it is, no chat template")
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None


class OllamaEmbedRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    input: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=2048)]
    truncate: bool = Field(default=True, description="Cut an input longer than the model's "
                           "context to fit (Ollama's default); false: such an input is a 400")
    dimensions: int | None = Field(default=None, ge=1, le=MAX_DIMENSIONS)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsRequest(OpenAIRequest):
    """The older /api/embeddings: one prompt, one vector."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaShowRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, data: Any) -> Any:
        """Older clients send the model as `name`."""
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


def data_url(image: str) -> str:
    """Ollama's bare base64 as the data URL the gateway's image store reads (the format is
    sniffed from the bytes, never taken from a declared type)."""
    return image if image.startswith("data:") else f"data:;base64,{image}"


def chat_images(request: OllamaChatRequest) -> list[str]:
    return [data_url(image) for m in request.messages for image in m.images or []]


def generate_images(request: OllamaGenerateRequest) -> list[str]:
    return [data_url(image) for image in request.images or []]


def _sampling(options: OllamaOptions | None, context_length: int) -> dict[str, Any]:
    options = options or OllamaOptions()
    predict = options.num_predict
    fields: dict[str, Any] = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "seed": options.seed,
        "stop": options.stop,
        "repetition_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        # The runner cuts this to what the context leaves after the prompt.
        "max_tokens": predict if predict is not None and predict > 0 else context_length,
    }
    if predict == 0:
        raise InvalidParameter("options.num_predict: 0 makes nothing; ask for 1 or more, or -1 "
                               "(until the model stops)", "options.num_predict")
    return {name: value for name, value in fields.items() if value is not None}


def response_format_of(format_: Format | None) -> ResponseFormat | None:
    """Ollama's `format` as the task's response format; a schema the runner could not compile
    is a 400 here, before anything is queued."""
    if not format_:
        return None
    if format_ == "json":
        response_format = ResponseFormat(type="json_object")
    else:
        assert isinstance(format_, dict)
        response_format = ResponseFormat(type="json_schema", json_schema=format_)
    try:
        grammar_for(response_format)
    except ValueError as exc:
        raise InvalidParameter(f"format: {exc}", "format") from None
    return response_format


def _content(text: str, images: list[str], hashes: dict[str, str]) -> Any:
    if not images:
        return text
    parts: list[dict[str, str]] = [{"type": "text", "text": text}] if text else []
    return parts + [{"type": "image", "sha256": hashes[data_url(image)]} for image in images]


def _messages(messages: list[OllamaMessage], hashes: dict[str, str]) -> list[dict[str, Any]]:
    """Wire messages. Ollama's tool calls have no ids: each gets one here, and a tool message
    answers the oldest call still unanswered of its tool (of any tool, without a name)."""
    unanswered: list[tuple[str, str]] = []  # (call id, function name), oldest first
    wire: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        fields: dict[str, Any] = {
            "role": message.role,
            "content": _content(message.content, message.images or [], hashes),
        }
        if message.tool_calls:
            calls = []
            for number, call in enumerate(message.tool_calls):
                call_id = f"call_{index}_{number}"
                unanswered.append((call_id, call.function.name))
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": orjson.dumps(call.function.arguments).decode(),
                }})
            fields["tool_calls"] = calls
        if message.role == "tool":
            answered = next((pair for pair in unanswered
                             if message.tool_name in (None, pair[1])), None)
            if answered is not None:
                unanswered.remove(answered)
            fields["tool_call_id"] = answered[0] if answered else f"call_{index}"
            if message.tool_name:
                fields["name"] = message.tool_name
        wire.append(fields)
    return wire


def _task(fields: dict[str, Any]) -> TextGeneration:
    try:
        return TextGeneration.model_validate(fields)
    except ValidationError as exc:
        raise invalid_from(exc) from None


def chat_task(
    request: OllamaChatRequest, task_id: str, hashes: dict[str, str], now: datetime,
    timeout_s: float, context_length: int, session: str | None = None,
) -> TextGeneration:
    """An /api/chat request as a task; `hashes` maps each image's data URL to its sha256."""
    fields = _sampling(request.options, context_length)
    if request.tools:
        fields["tools"] = [tool.model_dump() for tool in request.tools]
    if response_format := response_format_of(request.format):
        fields["response_format"] = response_format
    return _task({
        "task_id": task_id, "model": request.model, "deadline": deadline_after(now, timeout_s),
        "created_at": now, "messages": _messages(request.messages, hashes),
        **_with_session(session), **fields,
    })


def generate_task(
    request: OllamaGenerateRequest, task_id: str, hashes: dict[str, str], now: datetime,
    timeout_s: float, context_length: int, session: str | None = None,
) -> TextGeneration:
    """An /api/generate request as a task: a chat turn, or with `raw` the prompt as it is."""
    if request.suffix:
        raise InvalidParameter("suffix: filling in the middle is not supported", "suffix")
    if request.template:
        raise InvalidParameter("template: Fleet applies the model's own chat template",
                               "template")
    fields = _sampling(request.options, context_length)
    if response_format := response_format_of(request.format):
        fields["response_format"] = response_format
    if request.raw:
        if request.images:
            raise InvalidParameter("images: not with raw (a raw prompt has no place for them)",
                                   "images")
        fields["prompt"] = request.prompt
    else:
        turn = OllamaMessage(role="user", content=request.prompt, images=request.images)
        system = [OllamaMessage(role="system", content=request.system)] if request.system else []
        fields["messages"] = _messages([*system, turn], hashes)
    return _task({
        "task_id": task_id, "model": request.model, "deadline": deadline_after(now, timeout_s),
        "created_at": now, **_with_session(session), **fields,
    })


def _with_session(session: str | None) -> dict[str, Any]:
    return {"session": session} if session else {}
