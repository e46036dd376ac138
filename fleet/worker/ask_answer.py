"""The pure half of `fleet.ask.<model>`: what an ask asks for, and the answer its events make.

An ask's body is a task as published on `fleet.tasks.<model>`, with conveniences for people
typing at `nats req`: `type` defaults to text_generation, `model` to the subject's model,
`task_id` to a new one; a body that is not a JSON object is the user's message of a chat,
answered greedily in at most 64 tokens.
Without a `deadline` the task gets one at the ask's timeout, so a task still queued when its
asker has given up expires instead of running for nobody.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

import orjson

from fleet.bus.task_log import ordered
from fleet.wire.ask import AskAnswer, AskedImage
from fleet.wire.codec import DecodeError, decode_task
from fleet.wire.events import (
    EmbeddingChunk,
    ImageChunk,
    OutputEvent,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)
from fleet.wire.tasks import FunctionCall, Task, TextGeneration, ToolCall
from fleet.worker.outputs import event_msg_id

# Bare text is someone typing a question at `nats req`: a short answer, near-deterministic
# (at 1.0 and 256 tokens a small model rambled for 36 s). A task in JSON samples as it says.
PLAIN_TEXT_SAMPLING = {"temperature": 0.0, "max_tokens": 64}


def new_ask_id() -> str:
    return f"ask-{uuid.uuid4().hex}"


def ask_task(model: str, body: bytes, now: datetime, timeout_s: float, task_id: str) -> Task:
    """The task an ask on `fleet.ask.<model>` stands for; DecodeError names what is wrong.
    `task_id` is used when the body names none."""
    try:
        sent = orjson.loads(body)
    except orjson.JSONDecodeError:
        sent = None
    if not isinstance(sent, dict):
        prompt = body.decode(errors="replace").strip()
        if not prompt:
            raise DecodeError("an ask is a task (a JSON object) or the text of a question")
        sent = {"messages": [{"role": "user", "content": prompt}], **PLAIN_TEXT_SAMPLING}
    if sent.setdefault("model", model) != model:
        raise DecodeError(
            f"model: the task names {sent['model']!r} but was asked on fleet.ask.{model}",
            sent.get("task_id") if isinstance(sent.get("task_id"), str) else None,
        )
    sent.setdefault("type", "text_generation")
    sent.setdefault("task_id", task_id)
    sent.setdefault("deadline", (now + timedelta(seconds=timeout_s)).isoformat())
    return decode_task(orjson.dumps(sent))


def seen_whole(live: list[OutputEvent], stored: int) -> bool:
    """Whether the events seen live are the task's whole stream: a terminal among them, and as
    many distinct events (by the Nats-Msg-Id each is stored under: a continuation's re-sent
    event counts once) as FLEET_OUT holds. A live copy lost to a reconnect makes it fewer."""
    keys = {event_msg_id(event) for event in live}
    return any(isinstance(event, TaskFinished) for event in live) and len(keys) == stored


def answer_of(task: Task, events: Iterable[OutputEvent]) -> AskAnswer | None:
    """The answer a task's stored events make, or None while they hold no terminal. A token
    index seen twice (a continuation re-sending a dead worker's last tokens) counts once."""
    tokens: dict[int, str] = {}  # by first index, in index order (coalesced events differ)
    calls: dict[int, ToolCall] = {}
    images: dict[int, AskedImage] = {}
    vectors: dict[int, list[float] | str] = {}
    finished: TaskFinished | None = None
    # In index order: a copy stored twice once, an earlier attempt's tokens that a
    # continuation superseded not at all (fleet.bus.task_log).
    for event in ordered(events, release_held=True):
        match event:
            case TokenChunk(index=index, text=text):
                tokens.setdefault(index, text)
            case ToolCallChunk(index=index, id=call_id, name=name, arguments=arguments):
                calls.setdefault(index, ToolCall(
                    id=call_id, function=FunctionCall(name=name, arguments=arguments)
                ))
            case ImageChunk(partial_index=None) as image:
                images.setdefault(image.image_index, AskedImage(
                    sha256=image.sha256, image_index=image.image_index, format=image.format,
                    width=image.width, height=image.height,
                ))
            case EmbeddingChunk(index=first, embeddings=found):
                for offset, vector in enumerate(found):
                    vectors.setdefault(first + offset, vector)
            case TaskFinished() as finished:
                break
    if finished is None:
        return None
    text = "".join(tokens[i] for i in sorted(tokens))
    return AskAnswer(
        task_id=task.task_id, model=task.model, status=finished.status,
        finish_reason=finished.finish_reason, reason=finished.reason, message=finished.message,
        text=text if isinstance(task, TextGeneration) else None,
        tool_calls=[calls[i] for i in sorted(calls)] or None,
        images=[images[i] for i in sorted(images)] or None,
        embeddings=[vectors[i] for i in sorted(vectors)] or None,
        usage=finished.usage,
    )
