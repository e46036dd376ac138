"""Anthropic Messages requests in, a chat request out (the same task an OpenAI chat makes).
Pure: no I/O.

What maps to what:

- `system` (a string or text blocks) becomes the first, system message; a `system` message
  inside `messages` (Claude Code sends them) a system message where it stands.
- A user message's `tool_result` blocks become `tool` messages (`tool_use_id` is their
  `tool_call_id`), in order, before the rest of its text and image blocks.
- An assistant message's `tool_use` blocks become its `tool_calls` (`input` JSON-encoded as
  the `arguments`); `thinking` blocks are dropped (no fleet model reasons in them).
- `image` blocks (base64 or URL sources) become the chat path's image parts: a data: URL, or
  this gateway's image URL. A model without the `vision` capability answers 400.
- `tools` (`name`, `description`, `input_schema`) become functions; `tool_choice` auto, any,
  tool (one by name) and none become auto, required, a named function and no tools.
- `stop_sequences`, `max_tokens`, `temperature`, `top_p`, `top_k` map one to one. Anthropic's
  temperature range is 0-1, checked here as Anthropic does.

The request models ignore fields Fleet has no use for (`metadata`, `thinking`, `service_tier`,
`cache_control` on blocks) because clients send them, but check every field they read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, ValidationError

from fleet.errors import InvalidParameter
from fleet.gateway.bodies import OpenAIRequest, Timeout
from fleet.gateway.errors import invalid_from
from fleet.gateway.text_requests import (
    ChatCompletionRequest,
    FunctionCallIn,
    FunctionIn,
    FunctionNameIn,
    ImageContent,
    ImageURL,
    MessageIn,
    TextContent,
    ToolCallIn,
    ToolChoiceFunctionIn,
    ToolChoiceIn,
    ToolIn,
)


class TextBlock(OpenAIRequest):
    type: Literal["text"]
    text: str


class Base64Source(OpenAIRequest):
    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/webp", "image/gif"]
    data: str


class UrlSource(OpenAIRequest):
    type: Literal["url"]
    url: str = Field(description="This gateway's image URL (Fleet fetches nothing outside)")


class ImageBlock(OpenAIRequest):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ToolUseBlock(OpenAIRequest):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(OpenAIRequest):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(OpenAIRequest):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(OpenAIRequest):
    # Claude Code sends `system` messages mid-conversation (its beta of 2026-04).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolParam(OpenAIRequest):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceParam(OpenAIRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MetadataParam(OpenAIRequest):
    user_id: str | None = Field(default=None, description="Fleet: the task's session (its "
                                "conversation), unless X-Session-Id names one")


class MessagesRequest(OpenAIRequest):
    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=131072)
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=8)] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: MetadataParam | None = None
    timeout: Timeout | None = None


class CountTokensRequest(OpenAIRequest):
    """POST /v1/messages/count_tokens: the conversation, as a Messages request has it."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


def _image(block: ImageBlock) -> ImageContent:
    source = block.source
    url = (f"data:{source.media_type};base64,{source.data}"
           if isinstance(source, Base64Source) else source.url)
    return ImageContent(type="image_url", image_url=ImageURL(url=url))


def _parts(blocks: list[TextBlock | ImageBlock]) -> str | list[TextContent | ImageContent]:
    """Text alone stays a string (every chat template reads one); images make a part list."""
    if all(isinstance(block, TextBlock) for block in blocks):
        return "".join(block.text for block in blocks if isinstance(block, TextBlock))
    return [TextContent(type="text", text=block.text) if isinstance(block, TextBlock)
            else _image(block) for block in blocks]


def _tool_result(block: ToolResultBlock) -> MessageIn:
    content = block.content if isinstance(block.content, str) else _parts(list(block.content))
    if block.is_error and isinstance(content, str):
        content = f"Error: {content}"
    return MessageIn(role="tool", content=content, tool_call_id=block.tool_use_id)


def _user(content: list[Block]) -> list[MessageIn]:
    results = [_tool_result(b) for b in content if isinstance(b, ToolResultBlock)]
    rest = [b for b in content if isinstance(b, TextBlock | ImageBlock)]
    return results + ([MessageIn(role="user", content=_parts(rest))] if rest else [])


def _assistant(content: list[Block]) -> list[MessageIn]:
    text = "".join(b.text for b in content if isinstance(b, TextBlock))
    calls = [
        ToolCallIn(id=b.id, function=FunctionCallIn(name=b.name,
                                                    arguments=orjson.dumps(b.input).decode()))
        for b in content if isinstance(b, ToolUseBlock)
    ]
    if any(isinstance(b, ImageBlock | ToolResultBlock) for b in content):
        raise InvalidParameter("messages: an assistant message holds text and tool_use "
                               "blocks only", "messages")
    return [MessageIn(role="assistant", content=text, tool_calls=calls or None)]


def chat_messages(
    system: str | list[TextBlock] | None, messages: list[MessageParam]
) -> list[MessageIn]:
    """The conversation as chat messages (see the module's docstring)."""
    chat: list[MessageIn] = []
    if system:
        text = system if isinstance(system, str) else "".join(b.text for b in system)
        chat.append(MessageIn(role="system", content=text))
    for message in messages:
        if isinstance(message.content, str):
            chat.append(MessageIn(role=message.role, content=message.content))
        elif message.role == "system":
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            chat.append(MessageIn(role="system", content=text))
        elif message.role == "user":
            chat += _user(message.content)
        else:
            chat += _assistant(message.content)
    return chat


def tool_choice_of(choice: ToolChoiceParam | None) -> ToolChoiceIn | None:
    """Anthropic's tool_choice as the chat one; `tool` without a name is a 400."""
    if choice is None:
        return None
    match choice.type:
        case "any":
            return "required"
        case "tool":
            if not choice.name:
                raise InvalidParameter("tool_choice.name: required with type tool",
                                       "tool_choice.name")
            return ToolChoiceFunctionIn(type="function",
                                        function=FunctionNameIn(name=choice.name))
        case _:
            return choice.type


def _tools(tools: list[ToolParam] | None) -> list[ToolIn] | None:
    return [
        ToolIn(function=FunctionIn(name=t.name, description=t.description,
                                   parameters=t.input_schema))
        for t in tools
    ] if tools else None


def as_chat(request: MessagesRequest | CountTokensRequest, model: str) -> ChatCompletionRequest:
    """The chat request a Messages request stands for, for `model` (its alias resolved); a
    count_tokens request becomes one that makes a single token (its usage is the count)."""
    fields: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
    if isinstance(request, MessagesRequest):
        fields = {
            "max_tokens": request.max_tokens, "stream": request.stream,
            "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k, "stop": request.stop_sequences, "timeout": request.timeout,
        }
    try:
        return ChatCompletionRequest(
            model=model, messages=chat_messages(request.system, request.messages),
            tools=_tools(request.tools), tool_choice=tool_choice_of(request.tool_choice),
            **fields,
        )
    except ValidationError as exc:
        raise invalid_from(exc) from None
