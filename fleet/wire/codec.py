"""The one place where bytes meet wire types: orjson out, strict pydantic in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from fleet.wire.ask import AskReply
from fleet.wire.cluster import ClusterEvent
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished
from fleet.wire.runners import RunnerStatus
from fleet.wire.tasks import Task, is_task_id

M = TypeVar("M", bound=BaseModel)

TASK = TypeAdapter(Task)
OUTPUT_EVENT = TypeAdapter(OutputEvent)
CLUSTER_EVENT = TypeAdapter(ClusterEvent)
RUNNER_STATUS = TypeAdapter(RunnerStatus)
ASK_REPLY = TypeAdapter(AskReply)


class DecodeError(ValueError):
    """Bytes that are not the expected message; the text names the offending field."""

    def __init__(self, message: str, task_id: str | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id


def encode(message: BaseModel) -> bytes:
    return orjson.dumps(message.model_dump(mode="json", exclude_none=True))


def encode_accepted(event: TaskAccepted) -> bytes:
    """`encode(event)` without model_dump: a TaskAccepted's fields are JSON scalars, in
    declared order in its __dict__ (a model_copy's update too), so orjson of the ones not None
    is the codec's bytes (tests/wire/test_codec.py compares them). One a task: 3.6 -> 1.6 us
    (timeit, LOADED, 2026-12-05; issue 23)."""
    return orjson.dumps({k: v for k, v in event.__dict__.items() if v is not None})


def _describe(error: ValidationError) -> str:
    items = error.errors()
    if items and items[0]["type"] == "json_invalid":
        return f"not JSON: {items[0]['msg']}"
    parts = []
    for item in items[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "(message)"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _readable_task_id(data: bytes) -> str | None:
    """The task id of a message that failed validation, when it is a valid id as sent: never
    shortened or cleaned, which would put this message's failure on another task's id."""
    sent = sent_task_id(data)
    return sent if is_task_id(sent) else None


def sent_task_id(data: bytes) -> str | None:
    """The `task_id` string a message carries, valid or not (for reports, never a subject)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    task_id = obj.get("task_id") if isinstance(obj, dict) else None
    return task_id if isinstance(task_id, str) else None


def decode_with(adapter: TypeAdapter[Any], data: bytes) -> Any:
    """Strict: no coercion of wrong types ("12" is not an int); unknown fields rejected."""
    try:
        return adapter.validate_json(data, strict=True)
    except ValidationError as exc:
        raise DecodeError(_describe(exc), _readable_task_id(data)) from None


def decode_model(model: type[M], data: bytes) -> M:
    try:
        return model.model_validate_json(data, strict=True)
    except ValidationError as exc:
        raise DecodeError(_describe(exc), _readable_task_id(data)) from None


def decode_task(data: bytes) -> Task:
    """Decode a task; a DecodeError carries the task id when it could be read anyway."""
    return decode_with(TASK, data)


def decode_event(data: bytes) -> OutputEvent:
    """One message of `fleet.out.<task_id>` as it is stored. A reader of the task's events
    wants `decode_events`: a terminal may carry the task's last token events."""
    return decode_with(OUTPUT_EVENT, data)


def decode_events(data: bytes) -> list[OutputEvent]:
    """The events one message of `fleet.out.<task_id>` holds, in order (`expand`)."""
    return expand(decode_with(OUTPUT_EVENT, data))


def expand(event: OutputEvent) -> list[OutputEvent]:
    """Pure. A stored event as readers take it: a terminal that carries its last token
    events (`TaskFinished.last_tokens`, issue 23) is those events, then the terminal without
    them, as the worker would have stored them one by one; any other event is itself."""
    if type(event) is TaskFinished and event.last_tokens:
        return [*event.last_tokens, event.model_copy(update={"last_tokens": None})]
    return [event]


def expand_all(events: Iterable[OutputEvent]) -> list[OutputEvent]:
    """Pure. `expand` of each stored event, in order."""
    return [each for event in events for each in expand(event)]

