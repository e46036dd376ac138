"""Ollama requests as tasks and events as Ollama replies (fleet.gateway.ollama_requests,
fleet.gateway.ollama_replies): pure, no server."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from fleet.bus.task_events import Indexed
from fleet.errors import InvalidParameter, TaskFailed
from fleet.gateway.ollama_errors import ollama_error_body
from fleet.gateway.ollama_replies import OllamaRenderer, OllamaReply, timestamp
from fleet.gateway.ollama_requests import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    chat_task,
    generate_task,
)
from fleet.wire.events import (
    ErrorReason,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    Usage,
)

NOW = datetime(2026, 12, 3, tzinfo=UTC)
CONTEXT = 2048


def chat(**fields: Any) -> OllamaChatRequest:
    return OllamaChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, {"max_tokens": CONTEXT, "temperature": 1.0}),  # Ollama: until the context is full
        ({"num_predict": -1}, {"max_tokens": CONTEXT}),
        ({"num_predict": 7, "temperature": 0.2, "top_p": 0.5, "top_k": 9, "seed": 3},
         {"max_tokens": 7, "temperature": 0.2, "top_p": 0.5, "top_k": 9, "seed": 3}),
        ({"stop": ["\n"], "repeat_penalty": 1.1}, {"stop": ["\n"], "repetition_penalty": 1.1}),
        ({"num_ctx": 8192, "mirostat": 1}, {"max_tokens": CONTEXT}),  # no use here: ignored
    ],
)
def test_options_become_the_tasks_sampling(options: dict[str, Any], expected: dict[str, Any],
                                           ) -> None:
    task = chat_task(chat(options=options), "t", {}, NOW, 60, CONTEXT)
    assert {name: getattr(task, name) for name in expected} == expected


def test_num_predict_zero_and_a_bad_format_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidParameter) as zero:
        chat_task(chat(options={"num_predict": 0}), "t", {}, NOW, 60, CONTEXT)
    assert zero.value.param == "options.num_predict"
    assert chat_task(chat(format="json"), "t", {}, NOW, 60, CONTEXT).response_format.type == (  # type: ignore[union-attr]
        "json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = chat_task(chat(format=schema), "t", {}, NOW, 60, CONTEXT).response_format
    assert shaped is not None and shaped.json_schema == schema


def test_tool_calls_get_ids_and_tool_messages_answer_them_in_order() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "time", "content": "noon"},
        {"role": "tool", "content": "sunny"},
    ]
    task = chat_task(chat(messages=messages), "t", {}, NOW, 60, CONTEXT)
    assert task.messages is not None
    calls = task.messages[1].tool_calls or []
    assert [c.id for c in calls] == ["call_1_0", "call_1_1"]
    assert orjson.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [m.tool_call_id for m in task.messages[2:]] == ["call_1_1", "call_1_0"]


def test_generate_is_a_chat_turn_unless_raw() -> None:
    asked = {"model": "m", "prompt": "hi", "system": "be brief"}
    templated = generate_task(OllamaGenerateRequest.model_validate(asked), "t", {}, NOW, 60,
                              CONTEXT, session="s1")
    assert [m.role for m in templated.messages or []] == ["system", "user"]
    assert templated.session == "s1"
    raw = generate_task(OllamaGenerateRequest.model_validate({**asked, "raw": True}), "t", {},
                        NOW, 60, CONTEXT)
    assert raw.prompt == "hi" and raw.messages is None
    with pytest.raises(InvalidParameter):
        generate_task(OllamaGenerateRequest.model_validate({**asked, "suffix": "x"}), "t", {},
                      NOW, 60, CONTEXT)


T = "t"
EVENTS = [
    TaskAccepted(task_id=T, at=10.0, model="m", node_id="n", runner_id="r"),
    TokenChunk(task_id=T, at=10.5, index=0, token_id=1, text="Hel"),
    TokenChunk(task_id=T, at=11.0, index=1, token_id=2, text="lo"),
    TaskFinished(task_id=T, at=12.0, status="completed", finish_reason="length",
                 usage=Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)),
]
COUNTS = {"done": True, "done_reason": "length", "total_duration": 3_000_000_000,
          "load_duration": 0, "prompt_eval_count": 5, "prompt_eval_duration": 500_000_000,
          "eval_count": 2, "eval_duration": 1_500_000_000}


async def test_a_chat_reply_whole_and_streamed() -> None:
    reply = OllamaReply("m", "chat", started=9.0)
    whole = await OllamaRenderer(reply).body(EVENTS)
    assert whole == {"model": "m", "created_at": timestamp(12.0),
                     "message": {"role": "assistant", "content": "Hello"}, **COUNTS}
    renderer = OllamaRenderer(reply)
    lines = [line for index, event in enumerate(EVENTS)
             for line in await renderer.lines(Indexed(index, event, b""))]
    parts = [orjson.loads(line) for line in lines]
    assert [p["message"]["content"] for p in parts] == ["Hel", "lo", ""]
    assert [p["done"] for p in parts] == [False, False, True]
    assert parts[-1] == {"model": "m", "created_at": timestamp(12.0),
                         "message": {"role": "assistant", "content": ""}, **COUNTS}


async def test_a_generate_reply_tool_calls_and_a_failure() -> None:
    generated = await OllamaRenderer(OllamaReply("m", "generate", 9.0)).body(EVENTS)
    assert generated["response"] == "Hello" and "message" not in generated
    call = ToolCallChunk(task_id=T, at=11.0, index=0, id="c", name="weather",
                         arguments='{"city": "P"}')
    body = await OllamaRenderer(OllamaReply("m", "chat", 9.0)).body([*EVENTS[:1], call, EVENTS[-1]])
    assert body["message"]["tool_calls"] == [{"function": {"name": "weather",
                                                           "arguments": {"city": "P"}}}]
    [line] = OllamaRenderer(OllamaReply("m", "chat", 9.0)).failed(
        TaskFailed(ErrorReason.RUNNER_CRASHED, "the runner crashed"))
    assert orjson.loads(line) == {"error": "the runner crashed"} and line.endswith(b"\n")


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (400, b'{"error": {"message": "bad", "type": "x", "param": null, "code": "c"}}', "bad"),
        (404, b'{"error": "model \'x\' not found"}', "model 'x' not found"),  # already Ollama's
        (413, b"", "request entity too large"),  # no body: the status in words
        (499, b"not json", "error 499"),
    ],
)
def test_error_answers_in_ollamas_shape(status: int, body: bytes, error: str) -> None:
    assert orjson.loads(ollama_error_body(status, body)) == {"error": error}
