"""The pure half of fleet.ask: what an ask's body stands for, and the answer events make."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from fleet.wire.codec import DecodeError
from fleet.wire.events import (
    EmbeddingChunk,
    ErrorReason,
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
    Usage,
)
from fleet.wire.tasks import Embeddings, ImageGeneration, TextGeneration
from fleet.worker.ask_answer import answer_of, ask_task, seen_whole

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
SHA = "ab" * 32


def asked(body: bytes | dict, model: str = "tiny-llm") -> object:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return ask_task(model, data, NOW, 60.0, "ask-new")


def test_plain_text_is_the_user_message_of_a_chat() -> None:
    task = asked(b"What is the capital of France?\n")
    assert isinstance(task, TextGeneration)
    assert task.messages is not None and task.messages[0].content == (
        "What is the capital of France?"
    )
    assert (task.task_id, task.model) == ("ask-new", "tiny-llm")
    assert task.deadline == NOW + timedelta(seconds=60)
    assert (task.temperature, task.max_tokens) == (0.0, 64)  # a short, steady answer


def test_a_task_keeps_what_it_names_and_gets_the_rest() -> None:
    task = asked({"task_id": "mine-1", "prompt": "Once", "max_tokens": 3,
                  "deadline": "2026-12-02T12:00:05+00:00"})
    assert isinstance(task, TextGeneration)
    assert (task.task_id, task.prompt, task.max_tokens) == ("mine-1", "Once", 3)
    assert task.temperature != 0.0  # a task's own sampling: the plain-text one is not forced
    assert task.deadline == NOW + timedelta(seconds=5)  # its own, not the ask's


def test_an_image_task_is_asked_with_its_type() -> None:
    task = asked({"type": "image_generation", "prompt": "a fox"}, model="tiny-flux2")
    assert isinstance(task, ImageGeneration) and task.model == "tiny-flux2"


@pytest.mark.parametrize(("body", "says"), [
    (b"", "a task (a JSON object) or the text"),
    (b"   ", "a task (a JSON object) or the text"),
    (orjson.dumps({"model": "other", "task_id": "t-1", "prompt": "x"}), "fleet.ask.tiny-llm"),
    (orjson.dumps({"prompt": "x", "max_tokens": "3"}), "max_tokens"),
    (orjson.dumps({"prompt": "x", "colour": "red"}), "colour"),
    (orjson.dumps({"task_id": "a.b", "prompt": "x"}), "task_id"),
])
def test_what_is_not_a_task_is_refused_with_the_field(body: bytes, says: str) -> None:
    with pytest.raises(DecodeError, match=re.escape(says)):
        asked(body)


def test_a_wrong_model_keeps_the_task_id_for_the_reply() -> None:
    with pytest.raises(DecodeError) as caught:
        asked({"model": "other", "task_id": "t-1", "prompt": "x"})
    assert caught.value.task_id == "t-1"


TEXT = TextGeneration(task_id="t-1", model="tiny-llm", prompt="x")
IMAGE = ImageGeneration(task_id="i-1", model="tiny-flux2", prompt="x", n=2)


def token(index: int, text: str) -> TokenChunk:
    return TokenChunk(task_id="t-1", at=1.0, index=index, token_id=index, text=text)


def done(**fields: object) -> TaskFinished:
    return TaskFinished(task_id="t-1", at=2.0, **{"status": "completed", **fields})


def image(index: int, partial: int | None = None) -> ImageChunk:
    return ImageChunk(task_id="i-1", at=1.0, sha256=SHA, image_index=index,
                      partial_index=partial, format="png", width=8, height=8, size_bytes=9)


ACCEPTED = TaskAccepted(task_id="t-1", at=0.5, model="tiny-llm", node_id="n", runner_id="r")


def test_tokens_join_in_index_order_and_a_resent_index_counts_once() -> None:
    usage = Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    events: list[OutputEvent] = [
        ACCEPTED, token(0, "Pa"), token(1, "ri"), ACCEPTED, token(1, "ri"), token(2, "s"),
        done(finish_reason="length", usage=usage),
    ]
    answer = answer_of(TEXT, events)
    assert answer is not None
    assert (answer.text, answer.status, answer.finish_reason) == ("Paris", "completed", "length")
    assert answer.usage == usage and answer.images is None and answer.tool_calls is None


def test_tool_calls_are_answered_as_openai_tool_calls() -> None:
    call = ToolCallChunk(task_id="t-1", at=1.0, index=0, id="call_1", name="f",
                         arguments='{"a": 1}')
    answer = answer_of(TEXT, [call, done(finish_reason="tool_calls")])
    assert answer is not None and answer.tool_calls is not None
    assert answer.tool_calls[0].function.name == "f" and answer.text == ""


def test_an_image_task_answers_its_final_images_not_the_previews() -> None:
    answer = answer_of(IMAGE, [image(0, partial=0), image(1), image(0), done()])
    assert answer is not None and answer.text is None
    assert [i.image_index for i in answer.images or []] == [0, 1]


def test_an_embeddings_task_answers_its_vectors_in_input_order() -> None:
    task = Embeddings(task_id="t-1", model="tiny-embed", input=["a", "b", "c"])

    def vectors(index: int, found: list[list[float]], forward_pass: int) -> EmbeddingChunk:
        return EmbeddingChunk(task_id="t-1", at=1.0, index=index, encoding_format="float",
                              dimensions=1, embeddings=found, forward_pass=forward_pass)

    # A restarted task sends its first vectors again (the first copy counts).
    events = [vectors(2, [[3.0]], 2), vectors(0, [[1.0], [2.0]], 1), vectors(0, [[9.0]], 3),
              done(usage=Usage(prompt_tokens=3, total_tokens=3))]
    answer = answer_of(task, events)
    assert answer is not None and answer.text is None
    assert answer.embeddings == [[1.0], [2.0], [3.0]]
    assert isinstance(asked({"type": "embeddings", "input": ["hi"]}, "tiny-embed"), Embeddings)


def test_a_failure_is_an_answer_with_its_reason() -> None:
    ended = done(status="failed", reason=ErrorReason.CONTEXT_LENGTH, message="too long")
    answer = answer_of(TEXT, [ACCEPTED, ended])
    assert answer is not None
    assert (answer.status, answer.reason, answer.message) == (
        "failed", ErrorReason.CONTEXT_LENGTH, "too long")


def test_no_terminal_no_answer() -> None:
    assert answer_of(TEXT, [ACCEPTED, token(0, "a")]) is None


@pytest.mark.parametrize(("live", "stored", "whole"), [
    ([ACCEPTED, token(0, "a"), token(1, "b"), done()], 4, True),
    ([ACCEPTED, token(0, "a"), token(1, "b"), token(1, "b"), done()], 4, True),  # a re-send
    ([ACCEPTED, token(1, "b"), done()], 4, False),  # token 0 was lost live
    ([ACCEPTED, token(0, "a"), token(1, "b")], 3, False),  # no terminal seen
    ([ACCEPTED, token(0, "a"), token(1, "b"), done()], -1, False),  # the count is unknown
])
def test_live_events_stand_for_the_stream_only_when_provably_whole(
    live: list[OutputEvent], stored: int, whole: bool
) -> None:
    assert seen_whole(live, stored) is whole
