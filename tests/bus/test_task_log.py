"""A task's log (fleet.bus.task_log): the ordering rule as a table, then issue 24's gap at a
seam against a real nats-server: an attempt that stored tokens beyond a hole (one lost in a
leader change, its re-send refused by the fence), taken over by a continuation that batches
those indexes otherwise."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError, ServiceUnavailableError

from fleet.bus.task_events import TaskEvents
from fleet.bus.task_log import TaskLog, holds_message, ordered
from fleet.wire.events import (
    ErrorChunk,
    ErrorReason,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    token_indexes,
)
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.continuation import Continue, decide, generated_tokens, stored_events
from fleet.worker.outputs import TaskOutput, event_msg_id

OLD, NEW = 100, 500  # token ids: the earlier attempt's, the continuation's


def tok(index: int, count: int = 1, base: int = OLD, task_id: str = "t1") -> TokenChunk:
    ids = [base + index + k for k in range(count)]
    return TokenChunk(task_id=task_id, at=1.0, index=index, token_id=ids[0],
                      text="".join(f" {i}" for i in ids), token_ids=ids if count > 1 else None)


def accept(attempt: int, resumed: int = 0, task_id: str = "t1") -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=1.0, model="m", node_id=f"n{attempt}",
                        runner_id="r", attempt=attempt, delivery=attempt + 1,
                        continued_from=resumed)


def done(task_id: str = "t1") -> TaskFinished:
    return TaskFinished(task_id=task_id, at=1.0, status="completed", finish_reason="length")


def error() -> ErrorChunk:
    return ErrorChunk(task_id="t1", at=1.0, reason=ErrorReason.WORKER_LOST, message="x")


def shown(events: list[OutputEvent]) -> list[object]:
    """Events as short labels: ('t', index, first id, count), or the event's type."""
    return [("t", e.index, e.token_id, e.count) if isinstance(e, TokenChunk) else e.type
            for e in events]


A0, F = accept(0), done()
CASES = [
    # (stored order, read in index order)
    ("in order", [A0, tok(0), tok(1), tok(2), F],
     [A0, tok(0), tok(1), tok(2), F]),
    ("a re-send stored after later tokens (leader change): whole, put back in place",
     [A0, tok(0), tok(2), tok(3), tok(1), F],
     [A0, tok(0), tok(1), tok(2), tok(3), F]),
    ("an event stored twice (its ack lost, re-sent after it was stored): once",
     [A0, tok(0), tok(1), tok(1), tok(2), F],
     [A0, tok(0), tok(1), tok(2), F]),
    ("coalesced events reordered: an event of 3 tokens covers 3 indexes",
     [A0, tok(0), tok(4), tok(1, 3), F],
     [A0, tok(0), tok(1, 3), tok(4), F]),
    ("a hole no event fills: the terminal lets the held tokens out, in index order",
     [A0, tok(0), tok(3), tok(2), F],
     [A0, tok(0), tok(2), tok(3), F]),
    ("an error lets out what is held, then itself",
     [A0, tok(0), tok(2), error(), F],
     [A0, tok(0), tok(2), error(), F]),
    ("issue 24's seam: tokens beyond the hole at 2 are superseded by the continuation from 2, "
     "which batches them otherwise",
     [A0, tok(0), tok(1), tok(3), tok(4), accept(1, 2), tok(2, 2, NEW), tok(4, 3, NEW), F],
     [A0, tok(0), tok(1), accept(1, 2), tok(2, 2, NEW), tok(4, 3, NEW), F]),
    ("a continuation from 0 (killed before any token reached the stream whole)",
     [A0, tok(1), tok(2), accept(1, 0), tok(0, 4, NEW), F],
     [A0, accept(1, 0), tok(0, 4, NEW), F]),
    ("a first attempt's accept (a redelivery before any output) drops nothing",
     [tok(1), A0, tok(0), F],
     [A0, tok(0), tok(1), F]),
    ("two continuations, each resuming at a hole",
     [A0, tok(0), tok(2), accept(1, 1), tok(1, 2, NEW), tok(4, 1, NEW), accept(2, 3),
      tok(3, 3, NEW + 1000), F],
     [A0, tok(0), accept(1, 1), tok(1, 2, NEW), accept(2, 3), tok(3, 3, NEW + 1000), F]),
]


@pytest.mark.parametrize(("stored", "read"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_task_log_is_read_in_index_order(
    stored: list[OutputEvent], read: list[OutputEvent]
) -> None:
    assert shown(ordered(stored)) == shown(read)


def test_tokens_behind_a_hole_wait_until_released() -> None:
    """An unfinished task's read-back is the contiguous run (what a client has seen); the
    rest comes out only at a terminal or on request."""
    stored = [A0, tok(0), tok(2), tok(3)]
    assert shown(ordered(stored)) == shown([A0, tok(0)])
    assert shown(ordered(stored, release_held=True)) == shown([A0, tok(0), tok(2), tok(3)])


@pytest.mark.parametrize(("fence", "msg_id"), [
    (0, "t1-token-7"),  # a first attempt: a re-send of index 7 is stored once
    (42, "t1-token-7@42"),  # a takeover's own: never deduped against an earlier attempt's 7
])
def test_a_takeovers_events_have_msg_ids_of_their_own(fence: int, msg_id: str) -> None:
    assert event_msg_id(tok(7), fence) == msg_id
    assert event_msg_id(done(), fence) == "finished-t1"  # one terminal per task, whoever


def text_task(task_id: str) -> TextGeneration:
    return TextGeneration(task_id=task_id, model="m", messages=[ChatMessage(role="user",
                          content="hi")], max_tokens=11)


async def test_a_continuation_after_a_hole_leaves_no_gap(provisioned_nc: Client) -> None:
    """The earlier attempt stored 0..4 and, beyond the lost 5, 6 and 7 (one token each); the
    fence refused its re-send of 5. The continuation resumes at 5 and batches 5-6 and 7-10:
    before, its 7-10 carried the Msg-Id of the earlier 7 and was dropped as a duplicate, so
    8..10 were never stored (completed with a gap)."""
    nc, task_id = provisioned_nc, "seam-gap-1"
    js = nc.jetstream()
    old = TaskOutput(nc, js, budget_s=5.0)
    new = TaskOutput(nc, js, budget_s=5.0)
    await old.chunk(accept(0, task_id=task_id))
    for index in (0, 1, 2, 3, 4, 6, 7):  # 5 lost in the election
        await old.chunk(tok(index, task_id=task_id))
    assert await old.confirmed.settle(task_id) is None
    await new.take_over(task_id, "n1", delivery=2)
    decided = decide(text_task(task_id), await stored_events(nc, js, task_id))
    assert isinstance(decided, Continue)
    assert decided.generated == tuple(OLD + i for i in range(5))  # the contiguous run
    await new.chunk(accept(1, 5, task_id=task_id))
    await new.chunk(tok(5, 2, NEW, task_id=task_id))
    await new.chunk(tok(7, 4, NEW, task_id=task_id))
    assert (await new.finish(done(task_id))).status == "completed"

    log = TaskLog(nc, js, budget_s=5.0)
    stored = await log.stored(task_id)
    assert sorted(set(token_indexes(stored))) == list(range(11)), "a gap in the store"
    read = await log.read(task_id)
    want = [OLD + i for i in range(5)] + [NEW + i for i in (5, 6)] + [NEW + i for i in (7, 8, 9,
                                                                                        10)]
    assert [t for e in read if isinstance(e, TokenChunk) for t in e.ids] == want
    assert list(generated_tokens(read)) == want  # a second continuation builds on these
    assert await log.count(task_id) == len(stored)
    raw = await log.raw(task_id)
    assert len(raw) == len(stored) and [s for s, _ in raw] == sorted(s for s, _ in raw)
    assert await log.raw(task_id, after_seq=raw[-2][0]) == raw[-1:]
    assert isinstance(await log.last_event(task_id), TaskFinished)
    # A client reading the task as the gateway does sees the same, once each.
    deadline = asyncio.get_running_loop().time() + 10
    async with TaskEvents(js, task_id, deadline) as events:
        seen = [item.event async for item in events]
    assert [t for e in seen if isinstance(e, TokenChunk) for t in e.ids] == want


def test_an_asks_answer_is_the_text_a_client_read() -> None:
    """fleet.ask answers join the tokens in index order, superseded ones left out."""
    from fleet.worker.ask_answer import answer_of

    stored = [accept(0), tok(0), tok(1), tok(3), accept(1, 2), tok(2, 3, NEW), done()]
    answer = answer_of(text_task("t1"), stored)
    assert answer is not None
    assert answer.text == f" {OLD} {OLD + 1} {NEW + 2} {NEW + 3} {NEW + 4}"


@pytest.mark.parametrize(("answer", "expected"), [
    # the server's answers to `$JS.API.STREAM.MSG.GET.FLEET_OUT` with last_by_subj
    (b'{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":'
     b'{"subject":"fleet.out.t1","seq":7,"data":"e30=","time":"2026-12-05T06:00:00Z"}}', True),
    (b'{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":'
     b'{"code":404,"err_code":10037,"description":"no message found"}}', False),
    (b'{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":'
     b'{"code":404,"err_code":10059,"description":"stream not found"}}', False),
    (b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily '
     b'unavailable"}}', ServiceUnavailableError),
    (b'{"error":{"code":400,"err_code":10003,"description":"bad request"}}', APIError),
])
def test_what_a_message_get_answer_says(answer: bytes, expected: bool | type) -> None:
    if isinstance(expected, bool):
        assert holds_message(answer) is expected
    else:
        with pytest.raises(expected):  # type: ignore[call-overload]
            holds_message(answer)
