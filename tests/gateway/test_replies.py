"""Fleet events to OpenAI responses, chunks and SSE lines: pure, tables."""

from __future__ import annotations

import orjson
import pytest

from fleet.bus.task_events import Indexed
from fleet.errors import (
    DeadlineExceeded,
    InvalidParameter,
    ModelNotFound,
    QueueFull,
    Unauthorized,
    failure_of,
)
from fleet.gateway.errors import PROMPT_PARAM, error_body
from fleet.gateway.image_api import images_response, stream_event
from fleet.gateway.relay import sse, sse_error
from fleet.gateway.text_replies import ChatRenderer, CompletionRenderer, Reply
from fleet.wire.events import (
    ErrorChunk,
    ErrorReason,
    ImageChunk,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    TopLogprob,
    Usage,
    failed,
)

T = "chatcmpl-1"
REPLY = Reply(T, "tiny-llm", 100)
ACCEPTED = TaskAccepted(task_id=T, at=0, model="tiny-llm", node_id="n", runner_id="r")
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


def token(index: int, text: str, logprob: float | None = None) -> TokenChunk:
    tops = [TopLogprob(token=text, token_id=index, logprob=logprob)] if logprob else None
    return TokenChunk(
        task_id=T, at=1, index=index, token_id=index, text=text, logprob=logprob, top_logprobs=tops
    )


def done(finish: str | None = "stop") -> TaskFinished:
    return TaskFinished(task_id=T, at=2, status="completed", finish_reason=finish, usage=USAGE)


def test_chat_completion_from_events() -> None:
    body = REPLY.chat_completion(
        REPLY.by_choice([ACCEPTED, token(0, "Par"), token(1, "is"), done("length")])
    )
    assert body == {
        "id": T,
        "object": "chat.completion",
        "created": 100,
        "model": "tiny-llm",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_tool_calls_make_the_finish_reason_and_the_message() -> None:
    call = ToolCallChunk(task_id=T, at=1, index=0, id="call_1", name="f", arguments='{"x":1}')
    body = REPLY.chat_completion(REPLY.by_choice([call, done(None)]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    ]
    [chunk] = REPLY.chat_chunks(call, tool_calls_seen=1)
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 1


def test_logprobs_in_both_shapes() -> None:
    events = [token(0, "a", -0.5), token(1, "bc", -1.0), done()]
    with_logprobs = Reply(T, "m", 1, logprobs=True)
    chat = with_logprobs.chat_completion(with_logprobs.by_choice(events))
    assert chat["choices"][0]["logprobs"]["content"][1] == {
        "token": "bc",
        "logprob": -1.0,
        "bytes": [98, 99],
        "top_logprobs": [{"token": "bc", "logprob": -1.0, "bytes": [98, 99]}],
    }
    text = with_logprobs.text_completion(with_logprobs.by_choice(events))
    assert text["choices"][0]["logprobs"] == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"a": -0.5}, {"bc": -1.0}],
        "text_offset": [0, 1],
    }


@pytest.mark.parametrize(
    ("event", "deltas", "finish"),
    [
        (ACCEPTED, [], None),
        (token(0, "Hi"), [{"content": "Hi"}], None),
        (done(), [{}], "stop"),
    ],
)
def test_chat_chunks_per_event(event: object, deltas: list, finish: str | None) -> None:
    chunks = REPLY.chat_chunks(event, 0)  # type: ignore[arg-type]
    assert [c["choices"][0]["delta"] for c in chunks] == deltas
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    if chunks:
        assert chunks[-1]["choices"][0]["finish_reason"] == finish


async def test_usage_chunk_only_when_asked() -> None:
    reply = Reply(T, "m", 1, include_usage=True)
    [opening] = reply.chat_opening()
    assert opening["usage"] is None
    chat_lines = await ChatRenderer(reply).lines(Indexed(3, done(), b""))
    final, usage = [_data(line) for line in chat_lines]
    assert final["usage"] is None and final["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    text_lines = await CompletionRenderer(reply).lines(Indexed(3, done(), b""))
    text_final, text_usage = [_data(line) for line in text_lines]
    assert text_final["object"] == text_usage["object"] == "text_completion"
    assert text_usage["usage"]["prompt_tokens"] == 3
    assert len(await ChatRenderer(REPLY).lines(Indexed(3, done(), b""))) == 1


def _data(line: bytes) -> dict:
    return orjson.loads(line.split(b"data: ", 1)[1])


CHOICES = ("cmpl-9-0", "cmpl-9-1")


def _of(choice: int, event: TokenChunk | TaskFinished) -> TokenChunk | TaskFinished:
    usage = Usage(prompt_tokens=3, completion_tokens=2 + choice, total_tokens=5 + choice,
                  cached_tokens=1)
    update: dict = {"task_id": CHOICES[choice]}
    if isinstance(event, TaskFinished):
        update["usage"] = usage
    return event.model_copy(update=update)


def test_choices_in_one_body_with_the_prompt_counted_once() -> None:
    reply = Reply("cmpl-9", "m", 1, choice_ids=CHOICES)
    events = [_of(1, token(0, "B")), _of(0, token(0, "A")), _of(1, done("length")),
              _of(0, token(1, "a")), _of(0, done())]
    chat = reply.chat_completion(reply.by_choice(events))
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in chat["choices"]] == [
        (0, "Aa", "stop"), (1, "B", "length"),
    ]
    assert chat["id"] == "cmpl-9"
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    text = reply.text_completion(reply.by_choice(events))
    assert [c["text"] for c in text["choices"]] == ["Aa", "B"]


async def test_streamed_choices_carry_their_index_and_one_usage_at_the_end() -> None:
    reply = Reply("cmpl-9", "m", 1, include_usage=True, choice_ids=CHOICES)
    renderer = ChatRenderer(reply)
    assert [_data(line)["choices"][0]["index"] for line in renderer.opening()] == [0, 1]
    first = await renderer.lines(Indexed(2, _of(1, token(0, "B")), b""))
    assert _data(first[0])["choices"][0]["index"] == 1
    assert b"id:" not in first[0]  # event indexes are per task: no SSE id for several choices
    ended_one = await renderer.lines(Indexed(3, _of(1, done()), b""))
    assert [_data(line)["choices"][0]["finish_reason"] for line in ended_one] == ["stop"]
    ended_all = await renderer.lines(Indexed(3, _of(0, done("length")), b""))
    finish, usage = [_data(line) for line in ended_all]
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": "length"}
    assert usage["usage"]["completion_tokens"] == 5 and usage["choices"] == []


@pytest.mark.parametrize(
    ("finished", "status", "code"),
    [
        (done(), None, None),
        (failed(T, 1, ErrorReason.CONTEXT_LENGTH, "too long"), 400, "context_length_exceeded"),
        (failed(T, 1, ErrorReason.RUNNER_CRASHED, "died"), 502, "runner_crashed"),
        (failed(T, 1, ErrorReason.DEADLINE, "late"), 504, "deadline"),
        (TaskFinished(task_id=T, at=1, status="cancelled"), 499, "cancelled"),
        (TaskFinished(task_id=T, at=1, status="failed"), 500, "internal"),
    ],
)
def test_failures_carry_their_status(finished: TaskFinished, status: int | None, code: str) -> None:
    error = failure_of(finished)
    if status is None:
        assert error is None
        return
    assert error is not None and error.http_status == status
    assert error_body(error)["error"]["code"] == code


def test_a_context_overflow_has_openais_code_and_param_and_keeps_fleets_code() -> None:
    error = failure_of(failed(T, 1, ErrorReason.CONTEXT_LENGTH, "too long"))
    assert error is not None
    assert error_body(error)["error"] == {
        "message": "too long", "type": "invalid_request_error", "param": "messages",
        "code": "context_length_exceeded", "fleet_code": "context_length",
    }
    token = PROMPT_PARAM.set("prompt")  # a completion's prompt is its `prompt`
    try:
        assert error_body(error)["error"]["param"] == "prompt"
    finally:
        PROMPT_PARAM.reset(token)


def test_a_failure_without_a_message_borrows_the_error_chunk() -> None:
    chunk = ErrorChunk(task_id=T, at=1, reason=ErrorReason.INPUT_MISSING, message="no image abc")
    error = failure_of(TaskFinished(task_id=T, at=2, status="failed", reason=chunk.reason), chunk)
    assert error is not None and error.message == "no image abc"


@pytest.mark.parametrize(
    ("exc", "kind", "code", "param"),
    [
        (
            InvalidParameter("bad", "temperature"),
            "invalid_request_error",
            "invalid_task",
            "temperature",
        ),
        (ModelNotFound("x"), "invalid_request_error", "model_not_found", None),
        (QueueFull("x"), "rate_limit_error", "queue_full", None),
        (Unauthorized("x"), "authentication_error", "invalid_api_key", None),
        (DeadlineExceeded("x"), "timeout", "deadline", None),
    ],
)
def test_error_bodies(exc: Exception, kind: str, code: str, param: str | None) -> None:
    assert error_body(exc)["error"] == {  # type: ignore[arg-type]
        "message": exc.message,
        "type": kind,
        "param": param,
        "code": code,  # type: ignore[attr-defined]
    }


def test_sse_framing() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse({"a": 1}, event="x", event_id=3) == b'event: x\nid: 3\ndata: {"a":1}\n\n'
    line = sse_error(QueueFull("full"))
    assert line.startswith(b"event: error\ndata: ")
    assert orjson.loads(line.split(b"data: ")[1])["error"]["code"] == "queue_full"


def image(sha: str, index: int, partial: int | None = None) -> ImageChunk:
    return ImageChunk(
        task_id=T,
        at=1,
        sha256=sha,
        image_index=index,
        partial_index=partial,
        format="png",
        width=64,
        height=32,
        size_bytes=10,
    )


def test_image_stream_events_follow_openai() -> None:
    name, data = stream_event(image("a" * 64, 0, partial=1), "QUJD", "image_edit", 5, "u")
    assert name == data["type"] == "image_edit.partial_image"
    assert (data["partial_image_index"], data["size"], data["b64_json"]) == (1, "64x32", "QUJD")
    name, data = stream_event(image("a" * 64, 0), "QUJD", "image_generation", 5, "u")
    assert name == "image_generation.completed" and data["usage"]["total_tokens"] == 0


def test_images_response_orders_finals_and_picks_the_format() -> None:
    finals = [image("b" * 64, 1), image("a" * 64, 0)]
    b64 = {"a" * 64: "QQ==", "b" * 64: "Qg=="}
    urls = {sha: f"/v1/images/{sha}" for sha in b64}
    as_b64 = images_response(finals, 9, False, b64, urls)
    assert as_b64["data"] == [{"b64_json": "QQ=="}, {"b64_json": "Qg=="}]
    assert (as_b64["created"], as_b64["size"], as_b64["output_format"]) == (9, "64x32", "png")
    as_urls = images_response(finals, 9, True, {}, urls)
    assert as_urls["data"] == [{"url": urls["a" * 64]}, {"url": urls["b" * 64]}]


def test_prompts_are_each_counted_once_and_echo_leads_each_text() -> None:
    reply = Reply("cmpl-9", "m", 1, choice_ids=CHOICES, per_prompt=1, echo=("Once", "Twice"))
    events = [_of(0, token(0, " upon")), _of(1, token(0, " more")), _of(0, done()),
              _of(1, done())]
    body = reply.text_completion(reply.by_choice(events))
    assert [c["text"] for c in body["choices"]] == ["Once upon", "Twice more"]
    # two prompts of 3 tokens each, however many choices each has
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 5


async def test_a_streamed_echo_opens_with_each_prompt() -> None:
    reply = Reply("cmpl-9", "m", 1, choice_ids=CHOICES, echo=("Once", "Once"))
    renderer = CompletionRenderer(reply)
    opening = [_data(line)["choices"][0] for line in renderer.opening()]
    assert [(c["index"], c["text"]) for c in opening] == [(0, "Once"), (1, "Once")]
    assert CompletionRenderer(Reply("cmpl-8", "m", 1)).opening() == []
