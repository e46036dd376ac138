"""A task's stored stream has no gap: TaskOutput against a real nats-server that is SIGKILLed
and restarted on the same store, and against a stream that refuses an event.

What is stored is read back with nats-py's own ordered consumer, not through Fleet.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import nats
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from fleet.bus.confirmed import (
    ACK_TICK_S,
    ACK_TIMEOUT_S,
    WINDOW,
    ConfirmedPublisher,
    Storage,
    _Message,
    _problem,
    _Sequence,
    stored_whole,
)
from fleet.bus.connect import connect
from fleet.bus.embedded import EmbeddedNats, ops_dir
from fleet.bus.provision import provision
from fleet.bus.retry import with_retry
from fleet.errors import BrokerUnavailable
from fleet.wire import subjects
from fleet.wire.codec import decode_event, decode_events
from fleet.wire.events import (
    ErrorReason,
    OutputEvent,
    TaskAccepted,
    TaskFinished,
    TokenChunk,
    Usage,
)
from fleet.worker.outputs import TaskOutput, event_msg_id

TOKENS = 300


def accepted(task_id: str) -> TaskAccepted:
    return TaskAccepted(task_id=task_id, at=0.0, model="m", node_id="n", runner_id="r")


def token(task_id: str, index: int, text: str = "x") -> TokenChunk:
    return TokenChunk(task_id=task_id, at=0.0, index=index, token_id=index, text=text)


def completed(task_id: str, tokens: int) -> TaskFinished:
    return TaskFinished(
        task_id=task_id, at=0.0, status="completed", finish_reason="length",
        usage=Usage(completion_tokens=tokens, total_tokens=tokens),
    )


async def stored_events(nc: Client, task_id: str, timeout: float = 10.0) -> list[OutputEvent]:
    """Every event stored on the task's subject up to and including its terminal."""
    sub = await nc.jetstream().subscribe(subjects.out(task_id), ordered_consumer=True)
    found: list[OutputEvent] = []
    try:
        while not found or not isinstance(found[-1], TaskFinished):
            found.extend(decode_events((await sub.next_msg(timeout=timeout)).data))
    finally:
        await sub.unsubscribe()
    return found


def kill(server: EmbeddedNats) -> None:
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(10)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "store", port=0, log_file=tmp_path / "nats.log").start()
    nc = await nats.connect(server.url)
    await provision(nc)
    await nc.close()
    yield server
    server.stop()


# ---- pure: msg ids and the settle verdict ---------------------------------------------------

def test_msg_ids_name_the_task_the_kind_and_the_index() -> None:
    assert event_msg_id(token("t1", 7)) == "t1-token-7"
    assert event_msg_id(accepted("t1")) == "t1-task_accepted-1"
    assert event_msg_id(completed("t1", 1)) == "finished-t1"


@pytest.mark.parametrize(("seqs", "storage"), [
    ([1, 2, 5], Storage.IN_ORDER),  # whole, in order
    ([], Storage.IN_ORDER),
    ([1, 3, 2], Storage.REORDERED),  # whole, reordered: a re-send landed after later ones
    ([1, None, 5], Storage.MISSING),  # a gap
    ([1, 1], Storage.REORDERED),  # one event sent twice under its Msg-Id: stored once
    ([None], Storage.MISSING),
])
def test_stored_whole(seqs: list[int | None], storage: Storage) -> None:
    assert stored_whole(seqs) is storage


@pytest.mark.parametrize(("seqs", "refused", "verdict"), [
    ([1, 2, 5], None, None),
    ([], None, None),
    ([1, None, 5], None, "1 of 3 message(s) could not be stored"),
    ([1, 3, 2], None, None),  # whole but reordered is whole: readers read in index order
    ([1, 1], None, None),
    ([1, None], "too big", "the stream refused 1 message(s): too big"),
])
def test_settle_verdict(seqs: list[int | None], refused: str | None, verdict: str | None) -> None:
    seq = _Sequence("t")
    seq.messages = [_Message("s", b"", b"", seq=n) for n in seqs]
    if refused:
        seq.messages[-1].refused = refused
    assert _problem(seq) == verdict


async def test_a_wait_for_an_answer_ends_at_its_answer_or_within_a_tick_of_its_timeout() -> None:
    publisher = ConfirmedPublisher(cast(Client, None))  # waits only: nothing is sent
    seq = _Sequence("t")
    lost, answered = _Message("s", b"", b""), _Message("s", b"", b"")
    seq.messages = [lost, answered]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await publisher._answer(seq, lost, 0.3)
    assert 0.3 <= time.monotonic() - started < 0.3 + ACK_TICK_S + 0.5  # loaded machine
    loop = asyncio.get_running_loop()

    def answer() -> None:  # as _on_ack does
        answered.seq = 7
        seq.progress.set()

    loop.call_soon(answer)
    await publisher._answer(seq, answered, ACK_TIMEOUT_S)  # returns at the answer
    assert not publisher._deadlines  # no wait left behind
    await publisher.close()


# ---- a real server --------------------------------------------------------------------------

async def test_tokens_are_stored_in_order_then_the_terminal(server: EmbeddedNats) -> None:
    nc = await connect(server.url, "test-output")
    output = TaskOutput(nc, nc.jetstream())
    await output.chunk(accepted("t1"))
    for index in range(TOKENS):
        await output.chunk(token("t1", index))
    stored_terminal = await output.finish(completed("t1", TOKENS))
    assert stored_terminal.status == "completed"
    events = await stored_events(nc, "t1")
    assert [e.index for e in events if isinstance(e, TokenChunk)] == list(range(TOKENS))
    assert isinstance(events[0], TaskAccepted) and len(events) == TOKENS + 2
    assert not output.confirmed._waiting  # nothing kept of an ended task
    await nc.close()


@pytest.mark.timeout(120)
async def test_a_broker_sigkilled_and_restarted_mid_task_loses_nothing(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    nc = await connect(server.url, "test-output")
    output = TaskOutput(nc, nc.jetstream())
    await output.chunk(accepted("t1"))
    for index in range(100):
        await output.chunk(token("t1", index))
    await asyncio.to_thread(kill, server)
    for index in range(100, 200):  # some into the dead socket, the rest while reconnecting
        await output.chunk(token("t1", index))
    restarted = EmbeddedNats(server.store_dir, port=server.port, log_file=tmp_path / "n2.log")
    await asyncio.to_thread(restarted.start)
    try:
        for index in range(200, TOKENS):
            await output.chunk(token("t1", index))
        stored_terminal = await output.finish(completed("t1", TOKENS))
        assert stored_terminal.status == "completed"
        events = await stored_events(nc, "t1")
        indices = [e.index for e in events if isinstance(e, TokenChunk)]
        assert indices == list(range(TOKENS)), "a gap, a duplicate or a reordering"
        assert [type(e) for e in events[:1]] == [TaskAccepted]
        assert isinstance(events[-1], TaskFinished) and events[-1].status == "completed"
        assert len(events) == TOKENS + 2
        assert output.confirmed.repairs >= 1 and output.confirmed.resent >= 1
        assert not output.confirmed._waiting  # its sends lost unanswered are forgotten too
    finally:
        await nc.close()
        restarted.stop()


async def test_a_terminal_after_an_event_the_stream_refused_is_not_completed(
    tmp_path: Path,
) -> None:
    # FLEET_OUT with a small max_msg_size: a long token is refused by the stream for good.
    copy = tmp_path / "jetstream"
    shutil.copytree(ops_dir() / "jetstream", copy)
    path = copy / "FLEET_OUT.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_msg_size": 2000}))
    with EmbeddedNats(tmp_path / "store", port=0) as server:
        nc = await connect(server.url, "test-output")
        await provision(nc, copy)
        output = TaskOutput(nc, nc.jetstream(), budget_s=5.0)
        await output.chunk(token("t2", 0))
        await output.chunk(token("t2", 1, text="y" * 4000))  # refused: too big
        await output.chunk(token("t2", 2))
        stored_terminal = await output.finish(completed("t2", 3))
        assert stored_terminal.status == "failed"
        assert stored_terminal.reason is ErrorReason.OUTPUT_LOST
        events = await stored_events(nc, "t2")
        terminal = events[-1]
        assert isinstance(terminal, TaskFinished) and terminal.status == "failed"
        assert terminal.reason is ErrorReason.OUTPUT_LOST
        assert [e.index for e in events if isinstance(e, TokenChunk)] == [0, 2]
        await nc.close()


@pytest.mark.timeout(60)
async def test_a_terminal_during_an_outage_past_the_budget_raises_and_is_never_completed(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    nc = await connect(server.url, "test-output")
    output = TaskOutput(nc, nc.jetstream(), budget_s=2.0)
    await output.chunk(token("t3", 0))
    await asyncio.to_thread(kill, server)
    await output.chunk(token("t3", 1))
    with pytest.raises(BrokerUnavailable):  # the worker does not ack: the task is redelivered
        await output.finish(completed("t3", 2))
    restarted = EmbeddedNats(server.store_dir, port=server.port, log_file=tmp_path / "n2.log")
    await asyncio.to_thread(restarted.start)
    try:
        js = nc.jetstream()

        async def last_stored() -> OutputEvent | None:
            try:
                return decode_event(
                    (await js.get_last_msg(subjects.OUT_STREAM, subjects.out("t3"))).data
                )
            except NotFoundError:  # nothing stored (the kill took even token 0): no terminal
                return None

        # A terminal may have been stored after all (nats-py buffers a publish made while it
        # reconnects and sends it on reconnect), but never a completed one.
        last = await with_retry(last_stored, what="read back")
        assert not (isinstance(last, TaskFinished) and last.status == "completed")
    finally:
        await nc.close()
        restarted.stop()


@pytest.mark.timeout(120)
async def test_sending_never_waits_for_acks_past_the_window(server: EmbeddedNats) -> None:
    """The worker's loop sends every token event: with the server paused (no acks at all),
    twice the window of events is queued at once, not after an ack timeout per window; once it
    answers again they are all stored, in order."""
    nc = await connect(server.url, "test-output")
    output = TaskOutput(nc, nc.jetstream())
    await output.chunk(token("t4", 0))
    await nc.flush()  # the ack inbox's subscription is at the server before the pause
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for index in range(1, 2 * WINDOW + 1):
            await output.chunk(token("t4", index))
        queued_in = time.monotonic() - started
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    assert queued_in < ACK_TIMEOUT_S, f"{queued_in:.2f} s to queue {2 * WINDOW} events"
    stored_terminal = await output.finish(completed("t4", 2 * WINDOW + 1))
    assert stored_terminal.status == "completed"
    events = await stored_events(nc, "t4")
    assert [e.index for e in events if isinstance(e, TokenChunk)] == list(range(2 * WINDOW + 1))
    await nc.close()
