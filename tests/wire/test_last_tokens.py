"""A terminal that carries its task's last token events (`TaskFinished.last_tokens`, issue 23):
what it holds, and how every reader takes it (fleet.wire.codec.decode_events)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fleet.wire.codec import DecodeError, decode_event, decode_events, encode, expand_all
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk


def token(index: int, task_id: str = "t", ids: list[int] | None = None) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=1.5, index=index, token_id=(ids or [index])[0],
                      text=f"<{index}>", token_ids=ids)


def finished(**fields: Any) -> TaskFinished:
    return TaskFinished(task_id="t", at=2.0, status="completed", **fields)


def test_a_terminal_with_its_tokens_reads_as_those_tokens_then_itself() -> None:
    tail = [token(3), token(4, ids=[4, 5])]
    events = decode_events(encode(finished(last_tokens=tail)))
    assert events == [*tail, finished()]  # the terminal as it would have been stored alone
    assert [encode(e) for e in events] == [*(encode(t) for t in tail), encode(finished())]


def test_every_other_event_reads_as_itself() -> None:
    accepted = TaskAccepted(task_id="t", at=1.0, model="m", node_id="n", runner_id="r")
    for event in (accepted, token(0), finished()):
        assert decode_events(encode(event)) == [event]
    assert expand_all([accepted, finished(last_tokens=[token(0)])]) == [
        accepted, token(0), finished()]


def test_the_field_is_the_last_one_written_and_absent_when_empty() -> None:
    body = encode(finished(last_tokens=[token(0)]))
    assert body == encode(finished())[:-1] + b',"last_tokens":[' + encode(token(0)) + b"]}"
    assert b"last_tokens" not in encode(finished())


@pytest.mark.parametrize(("tail", "why"), [
    ([], "at least one"),
    ([token(0, task_id="other")], "own token events"),
    ([token(0), token(2)], "follow on"),
    ([token(0, ids=[0, 1]), token(1)], "follow on"),
])
def test_a_tail_that_is_not_the_tasks_own_in_order_is_refused(
    tail: list[TokenChunk], why: str
) -> None:
    data = orjson.loads(encode(finished()))
    data["last_tokens"] = [orjson.loads(encode(t)) for t in tail]
    with pytest.raises(DecodeError, match=why):
        decode_event(orjson.dumps(data))
