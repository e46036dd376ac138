"""OpenAI text requests in, Fleet tasks out: the request models and pure conversions.

The request models ignore fields Fleet has no use for (`user`, `store`, `metadata`…) because
every OpenAI client sends some, but they check the type and range of every field they read.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    WithJsonSchema,
)

from fleet.gateway.openai_base import InvalidParameter, OpenAIRequest
from fleet.gateway.reply_shape import (
    ResponseFormatIn,
    ToolChoiceIn,
    response_format_of,
    tool_choice_of,
)
from fleet.wire.tasks import TextGeneration


class ImageURL(OpenAIRequest):
    url: str = Field(description="A data: URL (PNG, JPEG or WebP) or this gateway's image URL")
    detail: str | None = None


class TextContent(OpenAIRequest):
    type: Literal["text"]
    text: str


class ImageContent(OpenAIRequest):
    type: Literal["image_url"]
    image_url: ImageURL


ContentItem = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class FunctionCallIn(OpenAIRequest):
    name: str
    arguments: str


class ToolCallIn(OpenAIRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentItem] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionIn(OpenAIRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolIn(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionIn


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=8)] | None
# JSON object keys are strings: token ids arrive as "42" and are checked as integers.
LogitBias = Annotated[
    dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
]
Timeout = Annotated[float, Field(gt=0, le=3600, description="Fleet: seconds before a 504")]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _SamplingRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000, description="Fleet extension")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Fleet extension")
    seed: Seed | None = None
    stop: Stop = None
    n: int = Field(
        default=1, ge=1, le=8,
        description="Choices; with more than one, choice i is the task <id>-<i>",
    )
    logit_bias: LogitBias | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=10.0,
        description="Fleet extension: mlx-lm's multiplicative penalty on the last 20 tokens",
    )
    timeout: Timeout | None = None
    resumable: bool = Field(
        default=False,
        description="Fleet: a dropped stream does not cancel the task; resume it from "
        "/v1/tasks/{id}/events",
    )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=131072)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=131072)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    response_format: ResponseFormatIn | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=16, ge=1, le=131072)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None


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


def image_urls(request: ChatCompletionRequest) -> list[str]:
    return [
        item.image_url.url
        for message in request.messages
        if isinstance(message.content, list)
        for item in message.content
        if isinstance(item, ImageContent)
    ]


def _content(content: str | list[ContentItem] | None, hashes: dict[str, str]) -> Any:
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": item.text}
        if isinstance(item, TextContent)
        else {"type": "image", "sha256": hashes[item.image_url.url]}
        for item in content
    ]


def _message(message: MessageIn, hashes: dict[str, str]) -> dict[str, Any]:
    """A message as wire JSON; the task validates it, so errors carry the message's path."""
    fields = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _content(message.content, hashes),
        "name": message.name,
        "tool_calls": [call.model_dump() for call in message.tool_calls or []] or None,
        "tool_call_id": message.tool_call_id,
    }
    return {name: value for name, value in fields.items() if value is not None}


def deadline_after(now: datetime, timeout_s: float) -> datetime:
    return now.astimezone(UTC) + timedelta(seconds=timeout_s)


def _sampling(request: _SamplingRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "logit_bias": request.logit_bias,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "stop": [request.stop] if isinstance(request.stop, str) else request.stop,
    }
    return {name: value for name, value in fields.items() if value is not None}


def chat_task(
    request: ChatCompletionRequest,
    task_id: str,
    hashes: dict[str, str],
    now: datetime,
    timeout_s: float,
) -> TextGeneration:
    """A chat request as a task; `hashes` maps each image URL to its sha256 in FLEET_IMAGES."""
    fields = _sampling(request)
    if request.tools and request.tool_choice != "none":
        fields["tools"] = [tool.model_dump() for tool in request.tools]
    names = [tool.function.name for tool in request.tools or []]
    if choice := tool_choice_of(request.tool_choice, names, request.response_format):
        fields["tool_choice"] = choice
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens:
        fields["max_tokens"] = max_tokens
    if request.response_format and request.response_format.type != "text":
        fields["response_format"] = response_format_of(request.response_format)
    try:
        return TextGeneration.model_validate(
            {
                "task_id": task_id,
                "model": request.model,
                "messages": [_message(m, hashes) for m in request.messages],
                "logprobs": request.logprobs,
                "top_logprobs": request.top_logprobs or 0,
                "deadline": deadline_after(now, timeout_s),
                "created_at": now,
                **fields,
            }
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None


def completion_task(
    request: CompletionRequest, task_id: str, now: datetime, timeout_s: float
) -> TextGeneration:
    prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
    fields = _sampling(request)
    if request.max_tokens:
        fields["max_tokens"] = request.max_tokens
    try:
        return TextGeneration(
            task_id=task_id,
            model=request.model,
            prompt=prompt,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
            deadline=deadline_after(now, timeout_s),
            created_at=now,
            **fields,
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None
