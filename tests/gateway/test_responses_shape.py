"""The pure half of /v1/responses: a Responses request as a chat request, and a task's events
as the `response` object and its SSE event sequence."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from fleet.bus.task_events import Indexed
from fleet.errors import InvalidParameter, TaskFailed
from fleet.gateway.responses_api import ResponsesRenderer, ResponsesRequest, as_chat, shape_of
from fleet.wire.events import (
    ErrorReason,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    Usage,
)


def request(**fields: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny-llm", "input": "hi", **fields})


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat = as_chat(request(instructions="Be brief.", max_output_tokens=7, temperature=0.2))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "hi")]
    assert (chat.max_completion_tokens, chat.temperature) == (7, 0.2)


def test_message_items_keep_their_roles_and_parts() -> None:
    chat = as_chat(request(input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Un chat."}]},
    ]))
    roles = [m.role for m in chat.messages]
    assert roles == ["developer", "user", "assistant"]
    user = chat.messages[1].content
    assert isinstance(user, list) and user[1].image_url.url.startswith("data:image/png")


def test_text_format_json_schema_is_chat_response_format() -> None:
    chat = as_chat(request(text={"format": {"type": "json_schema", "name": "city",
                                            "schema": {"type": "object"}}}))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.name == "city"


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp-1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
])
def test_what_fleet_cannot_serve_is_a_400_naming_the_parameter(
    fields: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidParameter) as caught:
        as_chat(request(**fields))
    assert caught.value.param == param


ACCEPTED = TaskAccepted(task_id="resp-1", at=1.0, model="tiny-llm", node_id="n",
                        runner_id="r")


def token(index: int, text: str) -> TokenChunk:
    return TokenChunk(task_id="resp-1", at=1.0, index=index, token_id=index, text=text)


def done(finish: str) -> TaskFinished:
    return TaskFinished(task_id="resp-1", at=2.0, status="completed", finish_reason=finish,
                        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5,
                                    cached_tokens=1))


def events_of(lines: list[bytes]) -> list[dict]:
    found = []
    for line in lines:
        head, data = line.split(b"data: ", 1)
        event = orjson.loads(data)
        assert f"event: {event['type']}\n".encode() in head
        found.append(event)
    return found


async def streamed(renderer: ResponsesRenderer, events: list[OutputEvent]) -> list[dict]:
    lines = renderer.opening()
    for index, event in enumerate(events, start=1):
        lines += await renderer.lines(Indexed(index, event, b""))
    return events_of(lines + renderer.closing())


def test_the_stream_is_the_responses_event_sequence_numbered_in_order() -> None:
    shape = shape_of(request(), "resp-1", 1700000000)
    events = asyncio.run(streamed(ResponsesRenderer(shape),
                                  [ACCEPTED, token(0, "Par"), token(1, "is"), done("stop")]))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Par", "is"]
    completed = events[-1]["response"]
    assert completed["status"] == "completed" and completed["id"] == "resp-1"
    assert completed["output"][0]["content"][0]["text"] == "Paris"
    assert completed["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    assert events[0]["response"]["status"] == "in_progress"


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    shape = shape_of(request(max_output_tokens=2), "resp-1", 1700000000)
    renderer = ResponsesRenderer(shape)
    events = asyncio.run(streamed(renderer, [token(0, "a"), token(1, "b"), done("length")]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    body = asyncio.run(renderer.body([token(0, "a"), token(1, "b"), done("length")]))
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "ab"
    assert body["max_output_tokens"] == 2


def test_a_task_that_fails_mid_stream_ends_with_response_failed() -> None:
    shape = shape_of(request(), "resp-1", 1700000000)
    renderer = ResponsesRenderer(shape)
    events = asyncio.run(streamed(renderer, [ACCEPTED, token(0, "Par")]))
    [line] = renderer.failed(TaskFailed(ErrorReason.RUNNER_CRASHED, "runner exited"))
    failed = events_of([line])[0]
    assert failed["type"] == "response.failed"
    assert failed["sequence_number"] == events[-1]["sequence_number"] + 1
    response = failed["response"]
    assert response["status"] == "failed"
    assert response["error"] == {"code": "runner_crashed", "message": "runner exited"}
    assert response["output"][0]["content"][0]["text"] == "Par"


def test_a_format_name_is_refused_as_the_document_says_not_after_it() -> None:
    """A json_schema format's name is held to chat's rule by the request model itself, so
    the OpenAPI document states it (the fuzz test sent a name with `-` and `\\u0084` that the
    document allowed and the chat conversion then refused)."""
    from pydantic import ValidationError

    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    with pytest.raises(ValidationError, match="name"):
        request(text={"format": {**fmt, "name": "bad name!"}})
    chat = as_chat(request(text={"format": {**fmt, "name": "answer_1"}}))
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.name == "answer_1"
    properties = ResponsesRequest.model_json_schema()["$defs"]["TextFormatIn"]["properties"]
    assert "^[A-Za-z0-9_-]+$" in orjson.dumps(properties["name"]).decode()
