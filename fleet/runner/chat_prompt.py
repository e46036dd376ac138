"""Turn a TextGeneration into prompt tokens, and find where its system prompt ends.

Chat requests go through the tokenizer's chat template (with tools when given); completions
are the raw prompt. The end of the system prompt is where requests that share one stop
sharing tokens: the prefix cache keeps the KV cache up to there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from mlx_lm.tokenizer_utils import TokenizerWrapper

from fleet.errors import TaskRejected
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import ChatMessage, ImagePart, TextGeneration


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    system_end: int  # tokens [0, system_end) are the shared system prompt; 0 when none


def build_prompt(tokenizer: TokenizerWrapper, task: TextGeneration) -> Prompt:
    if task.messages is None:
        tokens = list(tokenizer.encode(task.prompt or ""))
        system_end = 0
    else:
        tokens, system_end = _chat_tokens(tokenizer, task)
    if not tokens:
        raise TaskRejected(ErrorReason.INVALID_TASK, "the prompt is empty")
    return Prompt(tokens=tokens, system_end=system_end)


def _chat_tokens(tokenizer: TokenizerWrapper, task: TextGeneration) -> tuple[list[int], int]:
    messages = task.messages or []
    if any(message.image_hashes() for message in messages):
        raise TaskRejected(
            ErrorReason.UNSUPPORTED,
            "this model reads text only; remove the image parts or use a vision model",
        )
    if not tokenizer.has_chat_template:
        raise TaskRejected(
            ErrorReason.UNSUPPORTED,
            "this model has no chat template; send a plain `prompt` instead of `messages`",
        )
    rendered = [_as_template_message(message) for message in messages]
    template_kwargs: dict[str, Any] = {}
    if task.tools:
        template_kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in task.tools]
    try:
        tokens = list(
            tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **template_kwargs)
        )
    except TemplateError as error:
        raise TaskRejected(
            ErrorReason.INVALID_TASK, f"the model's chat template refused the messages: {error}"
        ) from error
    system_count = next(
        (i for i, message in enumerate(messages) if message.role != "system"), len(messages)
    )
    if system_count == 0 or system_count == len(messages):
        return tokens, 0
    # Render the system turn alone (with an empty user turn after it, as some templates
    # insist on one) and keep what it has in common with the whole prompt.
    try:
        system_only = tokenizer.apply_chat_template(
            [*rendered[:system_count], {"role": "user", "content": ""}],
            add_generation_prompt=False,
            **template_kwargs,
        )
    except TemplateError:
        return tokens, 0  # only the prefix cache loses: the prompt is still whole
    shared = 0
    for mine, whole in zip(system_only, tokens, strict=False):
        if mine != whole:
            break
        shared += 1
    return tokens, shared if shared < len(tokens) else 0


def _as_template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _text_of(message)}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        # Chat templates expect the arguments as an object; the wire carries OpenAI's JSON.
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_object(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return rendered


def _text_of(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content if not isinstance(part, ImagePart))


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
