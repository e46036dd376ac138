"""Output stored whole but out of order is read in index order, by every kind of reader.

The pure rule (IndexOrder) as a table, then the readers on a real nats-server: a lone reader
(`fleet follow`), and the gateway's shared subscription with a replay, which must number the
events exactly as the lone reader does (a resumed stream's `after=N` means the same to both).
"""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from fleet.bus.connect import js_publish
from fleet.bus.task_events import EventHub, IndexOrder, TaskEvents
from fleet.wire import subjects
from fleet.wire.events import (
    ErrorChunk,
    ErrorReason,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    ToolCallChunk,
)

T = "order-1"


def tok(index: int) -> TokenChunk:
    return TokenChunk(task_id=T, at=0.0, index=index, token_id=index, text=f"<{index}>")


def toks(first: int, count: int) -> TokenChunk:
    """One event carrying `count` tokens from index `first` (a runner's coalesced tokens)."""
    return TokenChunk(task_id=T, at=0.0, index=first, token_id=first, text=f"<{first}+>",
                      token_ids=list(range(first, first + count)))


def call(index: int) -> ToolCallChunk:
    return ToolCallChunk(task_id=T, at=0.0, index=index, id=f"c{index}", name="f", arguments="{}")


ACCEPTED = TaskAccepted(task_id=T, at=0.0, model="m", node_id="n", runner_id="r")
DONE = TaskFinished(task_id=T, at=0.0, status="completed")
ERROR = ErrorChunk(task_id=T, at=0.0, reason=ErrorReason.OUTPUT_LOST, message="lost")


def label(event: OutputEvent) -> str:
    match event:
        case TokenChunk(index=index):
            return f"t{index}"
        case ToolCallChunk(index=index):
            return f"c{index}"
    return event.type


@pytest.mark.parametrize(("stored", "read"), [
    # whole, in order
    ([ACCEPTED, tok(0), tok(1), tok(2), DONE],
     ["task_accepted", "t0", "t1", "t2", "task_finished"]),
    # whole, reordered: a re-sent token landed after later ones
    ([ACCEPTED, tok(0), tok(2), tok(3), tok(1), DONE],
     ["task_accepted", "t0", "t1", "t2", "t3", "task_finished"]),
    # a gap no event fills: what waits goes out, in order, before the terminal
    ([tok(0), tok(3), tok(2), DONE], ["t0", "t2", "t3", "task_finished"]),
    # and before an error, which comes ahead of the terminal
    ([tok(1), ERROR, DONE], ["t1", "error", "task_finished"]),
    # a duplicate (one event stored twice, outside the dedupe window): read once
    ([tok(0), tok(1), tok(1), tok(0), tok(2), DONE], ["t0", "t1", "t2", "task_finished"]),
    # tool calls are numbered on their own
    ([call(1), tok(0), call(0), DONE], ["t0", "c0", "c1", "task_finished"]),
    # events without an index go out as they come, even while a token waits
    ([tok(1), ACCEPTED, tok(0), DONE], ["task_accepted", "t0", "t1", "task_finished"]),
    # an event of several tokens covers their indexes: the next one's turn is after them
    ([tok(0), toks(1, 3), toks(4, 2), tok(6), DONE], ["t0", "t1", "t4", "t6", "task_finished"]),
    # ... also when it arrives after them, and a stored copy is read once
    ([tok(0), toks(4, 2), toks(1, 3), toks(1, 3), tok(6), DONE],
     ["t0", "t1", "t4", "t6", "task_finished"]),
])
def test_index_order(stored: list[OutputEvent], read: list[str]) -> None:
    order: IndexOrder[OutputEvent] = IndexOrder()
    out = [item for event in stored for item in order.push(event, event)]
    assert [label(event) for event in out] == read
    assert order.holding == 0


def test_an_undecodable_event_keeps_its_place() -> None:
    order: IndexOrder[str] = IndexOrder()
    assert order.push(tok(1), "t1") == []
    assert order.push(None, "junk") == ["junk"]
    assert order.holding == 1
    assert order.push(tok(0), "t0") == ["t0", "t1"]


REORDERED = [ACCEPTED, tok(0), tok(1), tok(3), tok(4), tok(2), tok(5), DONE]
IN_INDEX_ORDER = ["task_accepted", "t0", "t1", "t2", "t3", "t4", "t5", "task_finished"]


async def store(nc: Client, events: list[OutputEvent]) -> None:
    for event in events:
        await js_publish(nc.jetstream(), subjects.out(T), event)


async def test_a_lone_reader_reads_reordered_output_in_index_order(provisioned_nc: Client) -> None:
    await store(provisioned_nc, REORDERED)
    deadline = asyncio.get_running_loop().time() + 10
    async with TaskEvents(provisioned_nc.jetstream(), T, deadline) as events:
        seen = [(item.index, label(item.event)) async for item in events]
    assert seen == list(enumerate(IN_INDEX_ORDER, start=1))


async def test_replayed_and_live_events_are_numbered_alike(provisioned_nc: Client) -> None:
    """Half stored before the gateway's reader opens (replayed), half live: the same order and
    the same numbers as the lone reader, and a resume after N reads the rest only."""
    nc = provisioned_nc
    await store(nc, REORDERED[:4])  # ..., t3 stored, t2 not yet
    hub = EventHub(lambda: nc)
    loop = asyncio.get_running_loop()
    try:
        async with TaskEvents(nc.jetstream(), T, loop.time() + 10, hub=hub) as events:
            await store(nc, REORDERED[4:])
            seen = [(item.index, label(item.event)) async for item in events]
        assert seen == list(enumerate(IN_INDEX_ORDER, start=1))
        async with TaskEvents(nc.jetstream(), T, loop.time() + 10, after=4, hub=hub) as events:
            rest = [(item.index, label(item.event)) async for item in events]
        assert rest == list(enumerate(IN_INDEX_ORDER, start=1))[4:]
    finally:
        await hub.close()
