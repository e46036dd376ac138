"""Token events that reached the gateway together render as one chunk (fleet.gateway.token_runs):
the rule as tables, and the relay with a real ChatRenderer and ResponsesRenderer over an
in-memory reader whose events arrive in groups (in-process, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import orjson
import pytest

from fleet.bus.task_events import EventReader, Indexed
from fleet.errors import FleetError
from fleet.gateway.relay import Events, Observers, _relay, merges_tokens
from fleet.gateway.responses_api import ResponseShape, ResponsesRenderer
from fleet.gateway.text_replies import ChatRenderer, CompletionRenderer, Reply
from fleet.gateway.token_runs import MAX_RUN, joins, mergeable, merged
from fleet.wire.events import (
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    TopLogprob,
    Usage,
)

T = "chatcmpl-1"


def token(index: int, text: str, *, ids: list[int] | None = None, logprob: float | None = None,
          task_id: str = T, at: float = 1.0) -> TokenChunk:
    tops = [TopLogprob(token=text, token_id=index, logprob=logprob)] if logprob else None
    first = ids[0] if ids else index
    return TokenChunk(task_id=task_id, at=at, index=index, token_id=first, token_ids=ids,
                      text=text, logprob=logprob, top_logprobs=tops)


def at(position: int, event: OutputEvent) -> Indexed:
    return Indexed(position, event, b"raw")


ACCEPTED = TaskAccepted(task_id=T, at=0, model="m", node_id="n", runner_id="r")
DONE = TaskFinished(task_id=T, at=2, status="completed", finish_reason="stop",
                    usage=Usage(prompt_tokens=1, completion_tokens=7, total_tokens=8))


@pytest.mark.parametrize(("last", "item", "expected"), [
    (at(2, token(0, "a")), at(3, token(1, "b")), True),
    (at(2, token(0, "a", ids=[0, 1])), at(3, token(2, "c")), True),  # after a 2-token event
    (at(2, token(0, "a", ids=[0, 1])), at(3, token(1, "b")), False),  # not the next index
    (at(2, token(0, "a")), at(4, token(1, "b")), False),  # an event between (undecodable)
    (at(2, token(0, "a")), at(3, token(1, "b", task_id="other")), False),  # another choice
    (at(2, token(0, "a")), at(3, token(1, "b", logprob=-0.5)), False),  # its logprobs
    (at(2, token(0, "a")), at(3, DONE), False),
    (at(1, ACCEPTED), at(2, token(0, "a")), False),
])
def test_what_joins_a_run(last: Indexed, item: Indexed, expected: bool) -> None:
    assert joins(last, item) is expected


@pytest.mark.parametrize(("item", "expected"), [
    (at(2, token(0, "a")), True),
    (at(2, token(0, "ab", ids=[0, 1])), True),
    (at(2, token(0, "a", logprob=-0.5)), False),
    (at(1, ACCEPTED), False),
    (at(9, DONE), False),
])
def test_what_may_be_joined(item: Indexed, expected: bool) -> None:
    assert mergeable(item) is expected


def test_a_run_becomes_one_valid_multi_token_event_at_its_last_position() -> None:
    run = [at(3, token(1, "b", at=1.5)), at(4, token(2, "cd", ids=[2, 3], at=1.6)),
           at(5, token(4, "é", at=1.7))]
    one = merged(run)
    assert one.index == 5 and one.raw == b""
    assert one.event == TokenChunk(task_id=T, at=1.5, index=1, token_id=1,
                                   token_ids=[1, 2, 3, 4], text="bcdé")
    # What the model would accept from the wire, not only what model_copy built.
    assert TokenChunk.model_validate_json(one.event.model_dump_json(), strict=True) == one.event
    alone = at(3, token(1, "b"))
    assert merged([alone]) is alone


def test_which_renderers_join_runs() -> None:
    reply = Reply(T, "m", 100)
    assert merges_tokens(ChatRenderer(reply)) and merges_tokens(CompletionRenderer(reply))
    assert not merges_tokens(ResponsesRenderer(ResponseShape(T, "m", 100)))


class Arrivals(EventReader):
    """A reader whose events arrive in groups: within a group the next one is here already."""

    def __init__(self, groups: Sequence[Sequence[Indexed]]) -> None:
        self.items = [(item, n + 1 < len(group)) for group in groups
                      for n, item in enumerate(group)]
        self._ready_now = False

    def ready(self) -> bool:
        return bool(self.items) and self._ready_now

    async def __anext__(self) -> Indexed:
        if not self.items:
            raise StopAsyncIteration
        item, self._ready_now = self.items.pop(0)
        return item


class Seen:
    """The relay's observers, recording what they were shown."""

    def __init__(self) -> None:
        self.events: list[OutputEvent] = []
        self.errors: list[str] = []
        self.metrics = self

    def see(self, event: OutputEvent, now: float) -> None:
        self.events.append(event)

    def error(self, code: str) -> None:
        self.errors.append(code)


async def relayed(renderer: Any, reader: Arrivals) -> tuple[list[bytes], Seen]:
    seen = Seen()

    async def claim(item: Indexed) -> None:
        return None

    writes = [w async for w in _relay([], cast(Events, reader), renderer,
                                       cast(Observers, seen), claim)]
    return writes, seen


def sse_events(writes: list[bytes]) -> list[tuple[int | None, Any]]:
    """(id, data) of every SSE event written, in order."""
    out: list[tuple[int | None, Any]] = []
    for block in b"".join(writes).split(b"\n\n"):
        if not block:
            continue
        fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        data = fields[b"data"]
        out.append((int(fields[b"id"]) if b"id" in fields else None,
                    data if data == b"[DONE]" else orjson.loads(data)))
    return out


GROUPS = [
    [at(1, ACCEPTED)],
    [at(2, token(0, "The"))],  # the first token comes alone
    [at(3, token(1, " cap")), at(4, token(2, "ital", ids=[2, 3])), at(5, token(4, " of"))],
    [at(6, token(5, " France", logprob=-0.25)), at(7, token(6, " is"))],  # logprobs stay alone
    [at(8, token(7, " Paris")), at(9, DONE)],
]


async def test_chat_renders_each_run_that_arrived_together_as_one_chunk() -> None:
    writes, seen = await relayed(ChatRenderer(Reply(T, "m", 100)), Arrivals(GROUPS))
    events = sse_events(writes)
    contents = [(event_id, data["choices"][0]["delta"].get("content"))
                for event_id, data in events if isinstance(data, dict) and data["choices"]]
    assert contents == [
        (None, ""),  # the opening chunk (the role)
        (2, "The"), (5, " capital of"), (6, " France"), (7, " is"), (8, " Paris"), (9, None),
    ]
    assert events[-1] == (None, b"[DONE]")
    # Metrics saw every event as it came, merged or not; one write per group of arrivals
    # that renders anything (not the first: task_accepted), between the opening and [DONE].
    assert seen.events == [item.event for group in GROUPS for item in group]
    assert len(writes) == 1 + len(GROUPS) - 1 + 1 and not seen.errors


async def test_a_run_is_bounded() -> None:
    many = [at(2 + n, token(n, "x")) for n in range(MAX_RUN + 3)]
    writes, _ = await relayed(ChatRenderer(Reply(T, "m", 100)),
                              Arrivals([[*many, at(2 + MAX_RUN + 3, DONE)]]))
    texts = [data["choices"][0]["delta"].get("content") for _, data in sse_events(writes)
             if isinstance(data, dict) and data["choices"]]
    assert texts[1:3] == ["x" * MAX_RUN, "xxx"]


async def test_the_responses_api_keeps_one_delta_per_event() -> None:
    renderer = ResponsesRenderer(ResponseShape(T, "m", 100))
    writes, _ = await relayed(renderer, Arrivals(GROUPS))
    deltas = [data["delta"] for _, data in sse_events(writes)
              if isinstance(data, dict) and data["type"] == "response.output_text.delta"]
    assert deltas == ["The", " cap", "ital", " of", " France", " is", " Paris"]


async def test_a_failure_mid_run_renders_the_run_then_the_error() -> None:
    class Failing(Arrivals):
        async def __anext__(self) -> Indexed:
            if not self.items:
                raise FleetError("the deadline passed")
            return await super().__anext__()

    reader = Failing([[at(2, token(0, "a")), at(3, token(1, "b"))]])
    reader.items[-1] = (reader.items[-1][0], True)  # the next one seems here, then fails
    writes, seen = await relayed(ChatRenderer(Reply(T, "m", 100)), reader)
    events = sse_events(writes)
    assert [data["choices"][0]["delta"].get("content") for _, data in events[1:-1]] == ["ab"]
    assert "error" in events[-1][1] and seen.errors == ["internal"]
