"""The Messages API's pure parts: requests as chat messages, events as Anthropic's stream and
body, its error shape, and model aliases."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from fleet.bus.task_events import Indexed
from fleet.errors import InvalidParameter
from fleet.gateway.messages_replies import (
    MessagesRenderer,
    anthropic_error,
    error_type,
    stop_reason,
    tool_input,
)
from fleet.gateway.messages_requests import MessagesRequest, as_chat
from fleet.models.catalog import resolve_alias
from fleet.wire.events import OutputEvent, TaskFinished, TokenChunk, ToolCallChunk, Usage

ALIASES = {"claude-*": "tiny-llm", "claude-3-haiku*": "smollm2-135m", "gpt-4o": "tiny-llm"}


@pytest.mark.parametrize(("name", "model"), [
    ("gpt-4o", "tiny-llm"),
    ("claude-sonnet-4-5-20250929", "tiny-llm"),
    ("claude-3-haiku-20240307", "smollm2-135m"),  # the longer pattern wins
    ("gpt-4o-mini", None),
    ("llama", None),
])
def test_aliases_resolve_exact_then_longest_pattern(name: str, model: str | None) -> None:
    assert resolve_alias(name, ALIASES) == model


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (405, "invalid_request_error"), (413, "request_too_large"), (429, "rate_limit_error"),
    (500, "api_error"), (502, "api_error"), (503, "overloaded_error"), (504, "timeout_error"),
])
def test_each_status_has_anthropics_error_type(status: int, kind: str) -> None:
    assert error_type(status) == kind


def test_an_openai_error_body_becomes_anthropics() -> None:
    body = orjson.dumps({"error": {"message": "no model", "type": "invalid_request_error",
                                   "param": None, "code": "model_not_found"}})
    assert orjson.loads(anthropic_error(404, body)) == {"type": "error", "error": {
        "type": "not_found_error", "message": "no model", "code": "model_not_found"}}
    assert orjson.loads(anthropic_error(405, b""))["error"]["message"] == "HTTP 405"


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "claude-x", "max_tokens": 9, **fields})


def test_tool_use_and_results_become_tool_calls_and_tool_messages() -> None:
    asked = request(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain", "is_error": True},
                {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}},
            ]},
        ],
        tools=[{"name": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"}, stop_sequences=["END"], temperature=0.5, top_k=3,
    )
    chat = as_chat(asked, "tiny-llm")
    assert chat.model == "tiny-llm" and chat.tool_choice == "required"
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["END"], 0.5, 3, 9)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Looking."),
        ("tool", "Error: rain"), ("user", "And now?"),
    ]
    [call] = chat.messages[2].tool_calls or []
    assert (call.id, call.function.name, orjson.loads(call.function.arguments)) == (
        "t1", "weather", {"city": "Oslo"})
    assert chat.messages[3].tool_call_id == "t1"
    assert chat.tools and chat.tools[0].function.parameters == {"type": "object"}


def test_a_named_tool_choice_needs_its_name() -> None:
    with pytest.raises(InvalidParameter) as refused:
        as_chat(request(messages=[{"role": "user", "content": "x"}],
                        tools=[{"name": "a", "input_schema": {}}], tool_choice={"type": "tool"}),
                "tiny-llm")
    assert refused.value.param == "tool_choice.name"


def test_images_become_the_chat_paths_image_parts() -> None:
    chat = as_chat(request(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
        {"type": "text", "text": "What?"},
    ]}]), "tiny-llm")
    parts = chat.messages[0].content
    assert isinstance(parts, list) and parts[0].image_url.url == "data:image/png;base64,AA=="


def events() -> list[OutputEvent]:
    return [
        TokenChunk(task_id="m", index=0, token_id=1, text="Hi", at=0.0),
        TokenChunk(task_id="m", index=1, token_id=2, text=" there", at=0.0),
        ToolCallChunk(task_id="m", index=0, id="c1", name="weather",
                      arguments='{"city":"Oslo"}', at=0.0),
        TaskFinished(task_id="m", status="completed", finish_reason="tool_calls", at=0.0,
                     usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15,
                                 cached_tokens=4)),
    ]


def test_a_stream_opens_blocks_as_they_come_and_ends_with_the_stop_reason() -> None:
    renderer = MessagesRenderer("m", "tiny-llm")
    lines = renderer.opening()
    for index, event in enumerate(events()):
        lines += asyncio.run(renderer.lines(Indexed(index, event, b"")))
    data = [orjson.loads(line.split(b"data: ", 1)[1]) for line in lines]
    assert [d["type"] for d in data] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    assert data[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "weather",
                                        "input": {}}
    assert data[7] == {"type": "content_block_delta", "index": 1, "delta": {
        "type": "input_json_delta", "partial_json": '{"city":"Oslo"}'}}
    assert data[9]["delta"]["stop_reason"] == "tool_use"
    usage = data[9]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (6, 4)


def test_the_whole_message_holds_the_text_then_the_calls() -> None:
    body = asyncio.run(MessagesRenderer("m", "tiny-llm").body(events()))
    assert body["content"] == [
        {"type": "text", "text": "Hi there"},
        {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Oslo"}},
    ]
    assert (body["stop_reason"], body["usage"]["output_tokens"]) == ("tool_use", 5)


@pytest.mark.parametrize(("arguments", "value"), [
    ('{"a": 1}', {"a": 1}), ("", {}), ("[1]", {"arguments": [1]}), ("{bad", {"arguments": "{bad"}),
])
def test_tool_arguments_always_become_an_object(arguments: str, value: dict[str, Any]) -> None:
    assert tool_input(arguments) == value


def test_a_system_message_inside_the_conversation_stays_where_it_is() -> None:
    chat = as_chat(request(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "Now be brief."}]},
    ]), "tiny-llm")
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "Hi"), ("system", "Now be brief.")]


@pytest.mark.parametrize(("finish_reason", "stop_sequence", "tools", "reason"), [
    ("stop", None, False, "end_turn"),
    ("stop", "END", False, "stop_sequence"),
    ("length", None, False, "max_tokens"),
    ("tool_calls", None, True, "tool_use"),
    ("stop", None, True, "tool_use"),
])
def test_stop_reason(finish_reason: str, stop_sequence: str | None, tools: bool,
                     reason: str) -> None:
    finished = TaskFinished(task_id="m", status="completed", at=0.0,
                            finish_reason=finish_reason, stop_sequence=stop_sequence)
    assert stop_reason(finished, tools) == reason


def test_the_stop_string_that_ended_the_text_is_named() -> None:
    finished = TaskFinished(task_id="m", status="completed", at=0.0, finish_reason="stop",
                            stop_sequence="END", usage=Usage(prompt_tokens=3,
                            completion_tokens=2, total_tokens=5))
    body = asyncio.run(MessagesRenderer("m", "tiny-llm").body([finished]))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
