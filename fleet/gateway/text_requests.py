"""OpenAI text requests in, Fleet tasks out: the request models and pure conversions,
the shape a reply must take, and the `n` choices of one request.

The request models ignore fields Fleet has no use for (`user`, `store`, `metadata`…) because
every OpenAI client sends some, but they check the type and range of every field they read.

The shape a chat reply must take, as OpenAI asks for it: `response_format` (JSON mode, a
JSON Schema) and `tool_choice` (a call required, or of one named function). Both become a
grammar the runner enforces token by token; one a runner could not compile is a 400 here,
before anything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from fleet.errors import InvalidParameter
from fleet.gateway.bodies import OpenAIRequest, Seed, Timeout, deadline_after
from fleet.gateway.errors import invalid_from
from fleet.grammar import grammar_for
from fleet.wire.tasks import ResponseFormat, TextGeneration


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
    prompt_cache_key: str | None = Field(
        default=None, description="The conversation's session id: its turns go to the runner "
        "that holds its prefix cache (so does the X-Session-Id header, which wins)",
    )
    user: str | None = Field(default=None, description="The session id, without a "
                             "prompt_cache_key")

    @property
    def session_fields(self) -> dict[str, object]:
        """Where the body may name a session, most specific first (fleet.gateway.sessions)."""
        return {"prompt_cache_key": self.prompt_cache_key, "user": self.user}

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


MAX_CHOICES = 16  # prompts × n of one completion request: each is a task


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] = Field(
        description="One prompt, or a list: one choice per prompt (× n), in prompt order"
    )
    max_tokens: int | None = Field(default=16, ge=1, le=131072)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False, description="The text starts with its prompt")
    suffix: None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


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


def completion_tasks(
    request: CompletionRequest, task_id: str, now: datetime, timeout_s: float
) -> list[TextGeneration]:
    """One task per choice: `n` for each prompt, choice i·n + j being prompt i's j-th (as
    OpenAI orders them), `<id>-<index>` when there is more than one."""
    prompts = request.prompts
    if len(prompts) * request.n > MAX_CHOICES:
        raise InvalidParameter(
            f"n: {len(prompts)} prompts × n = {request.n} asks for more than {MAX_CHOICES} "
            "choices", "n",
        )
    if request.echo and request.logprobs is not None:
        raise InvalidParameter("echo: not with logprobs (the prompt's own logprobs are not "
                               "computed)", "echo")
    refuse_resumable_choices(len(prompts) * request.n, request.resumable)
    if len(prompts) == 1:
        return choice_tasks(completion_task(request, task_id, now, timeout_s), request.n)
    tasks = []
    for index, prompt in enumerate(prompts):
        first = completion_task(request, f"{task_id}-{index * request.n}", now, timeout_s,
                                prompt)
        tasks += [first] if request.n == 1 else [
            choice.model_copy(update={"task_id": f"{task_id}-{index * request.n + j}"})
            for j, choice in enumerate(choice_tasks(first, request.n))
        ]
    return tasks


def completion_task(
    request: CompletionRequest, task_id: str, now: datetime, timeout_s: float,
    prompt: str | None = None,
) -> TextGeneration:
    """The task of one prompt (the request's first, unless `prompt` names another)."""
    prompt = request.prompts[0] if prompt is None else prompt
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


# A json_schema format's name, as OpenAI constrains it (chat's response_format and the
# Responses API's text.format share it, so both documents say what is refused).
SchemaName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class JsonSchemaIn(OpenAIRequest):
    name: SchemaName
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(OpenAIRequest):
    # One model rather than a tagged union: a union's tag would show up in the `param` of
    # every error inside it. The document still says that json_schema goes with its type.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
    })

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatIn:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class FunctionNameIn(OpenAIRequest):
    name: str


class ToolChoiceFunctionIn(OpenAIRequest):
    type: Literal["function"]
    function: FunctionNameIn


ToolChoiceIn = Literal["none", "auto", "required"] | ToolChoiceFunctionIn


def response_format_of(requested: ResponseFormatIn) -> ResponseFormat:
    """The task's response format, refused here (400) when its schema cannot be compiled,
    rather than by a runner after the request was queued."""
    schema = requested.json_schema.schema_ if requested.json_schema else None
    response_format = ResponseFormat(type=requested.type, json_schema=schema)
    try:
        grammar_for(response_format)
    except ValueError as exc:
        raise InvalidParameter(str(exc), "response_format") from None
    return response_format


def tool_choice_of(
    choice: ToolChoiceIn | None,
    tool_names: Sequence[str],
    response_format: ResponseFormatIn | None,
) -> str | dict[str, str] | None:
    """The task's tool choice (None: auto); a choice the tools cannot satisfy is a 400."""
    if choice in (None, "auto", "none"):
        return None
    names = list(tool_names)
    if not names:
        raise InvalidParameter("tool_choice: there are no tools to choose from", "tool_choice")
    if response_format and response_format.type != "text":
        raise InvalidParameter(
            "tool_choice: a forced tool call and a response_format cannot both shape the reply",
            "tool_choice",
        )
    if isinstance(choice, ToolChoiceFunctionIn):
        if choice.function.name not in names:
            raise InvalidParameter(
                f"tool_choice: {choice.function.name!r} is not one of the tools", "tool_choice"
            )
        return {"type": "function", "name": choice.function.name}
    return "required"


SEED_MAX = 2**63 - 1  # the gateway's own bound for a seed


def choice_tasks(task: TextGeneration, n: int) -> list[TextGeneration]:
    """The task itself for n = 1, else one task per choice; choice 0 keeps the seed, so it
    draws what the same request with n = 1 draws."""
    if n == 1:
        return [task]
    return [
        task.model_copy(update={"task_id": f"{task.task_id}-{index}",
                                "seed": _choice_seed(task.seed, index)})
        for index in range(n)
    ]


def _choice_seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    return seed + index if seed + index <= SEED_MAX else seed - index


def refuse_resumable_choices(n: int, resumable: bool) -> None:
    if n > 1 and resumable:
        raise InvalidParameter(
            "n: a resumable stream carries one choice (ask with n = 1, or without resumable "
            "and resume each choice's task from /v1/tasks/<id>-<index>/events)", "n",
        )
