"""The token coalescing rule (a table) and the coalescer that applies it to runner reports."""

from __future__ import annotations

import threading
import time

import pytest

from fleet.runner.coalesce import MAX_TOKENS, WINDOW_S, TokenCoalescer, Written, flush_due
from fleet.runner.engine import Token
from fleet.wire.events import TaskFinished, TokenChunk, ToolCallChunk
from fleet.wire.framing import decode_report
from fleet.wire.pipe import RunnerReport


class Sent(list[RunnerReport]):
    """What the coalescer wrote, as reports: its token events come encoded, and must decode
    strictly to the TokenChunk they stand for."""

    def append(self, written: Written) -> None:
        super().append(decode_report(written) if isinstance(written, bytes) else written)


@pytest.mark.parametrize(
    ("tokens", "first", "ended", "held_s", "next_step_s", "due"),
    [
        (1, True, False, 0.0, 0.0, True),  # the first token is never held
        (1, False, False, 0.0, 0.0, False),  # a later one waits for company
        (1, False, False, 0.0, 0.0001, False),  # the next step is quick: keep waiting
        (3, False, False, 0.004, 0.0005, False),  # still inside the window after the next step
        (3, False, False, 0.004, 0.002, True),  # the next step would take it past the window
        (1, False, False, 0.0, 0.030, True),  # a slow model: every token goes at once
        # A step nearly the window long would end at its edge: the token would wait the
        # window for company it most likely misses, so it goes now.
        (1, False, False, 0.0, 0.0045, True),
        (1, False, False, 0.0, 0.0034, True),
        (1, False, False, 0.0, 0.003, False),  # two steps of 3 ms fit: one wait, 2 tokens
        (3, False, False, WINDOW_S, 0.0, True),  # the window is up
        (MAX_TOKENS - 1, False, False, 0.0, 0.0, False),
        (MAX_TOKENS, False, False, 0.0, 0.0, True),  # a full batch leaves
        (2, False, True, 0.0, 0.0, True),  # the task's next event (its terminal) sends them
    ],
)
def test_flush_due(tokens: int, first: bool, ended: bool, held_s: float, next_step_s: float,
                   due: bool) -> None:
    assert flush_due(tokens=tokens, first=first, ended=ended, held_s=held_s,
                     next_step_s=next_step_s) is due


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def token(task_id: str, index: int) -> TokenChunk:
    return TokenChunk(task_id=task_id, at=100.0 + index, index=index, token_id=1000 + index,
                      text=f" t{index}")


def finished(task_id: str) -> TaskFinished:
    return TaskFinished(task_id=task_id, at=200.0, status="completed", finish_reason="stop")


def test_the_coalescer_keeps_each_task_whole_and_in_order() -> None:
    clock = Clock()
    sent = Sent()
    coalescer = TokenCoalescer(sent.append, clock=clock)
    for index in range(3):  # one engine step per token, two tasks in the batch
        coalescer(token("a", index))
        coalescer(token("b", index))
        clock.now += 0.0005
        coalescer.step_ended(0.0005)
    # First tokens alone and at once; the next two of each task still held.
    assert [(e.task_id, e.index) for e in sent if isinstance(e, TokenChunk)] == [("a", 0),
                                                                                 ("b", 0)]
    coalescer(ToolCallChunk(task_id="a", at=1.0, index=0, id="c", name="f", arguments="{}"))
    coalescer(finished("b"))
    kinds = [(e.type, e.task_id, getattr(e, "index", None), getattr(e, "token_ids", None))
             for e in sent[2:]]
    assert kinds == [
        ("token", "a", 1, [1001, 1002]), ("tool_call", "a", 0, None),
        ("token", "b", 1, [1001, 1002]), ("task_finished", "b", None, None),
    ]
    merged = sent[2]
    assert isinstance(merged, TokenChunk)
    assert (merged.text, merged.at, merged.next_index) == (" t1 t2", 101.0, 3)


def test_a_full_batch_and_the_window_send_held_tokens() -> None:
    clock = Clock()
    sent = Sent()
    coalescer = TokenCoalescer(sent.append, clock=clock)
    for index in range(1 + MAX_TOKENS):
        coalescer(token("a", index))
    assert [e.count for e in sent if isinstance(e, TokenChunk)] == [1, MAX_TOKENS]
    coalescer(token("a", 1 + MAX_TOKENS))
    clock.now += 0.001
    coalescer.step_ended(0.0001)
    assert len(sent) == 2  # held: the window is not up
    clock.now += WINDOW_S
    coalescer.step_ended(0.0001)
    assert [e.index for e in sent if isinstance(e, TokenChunk)] == [0, 1, 1 + MAX_TOKENS]


def test_a_token_with_logprobs_travels_alone() -> None:
    sent = Sent()
    coalescer = TokenCoalescer(sent.append, clock=Clock())
    coalescer(token("a", 0))
    coalescer(token("a", 1))
    coalescer(token("a", 2).model_copy(update={"logprob": -0.5}))
    assert [(e.index, e.count) for e in sent if isinstance(e, TokenChunk)] == [
        (0, 1), (1, 1), (2, 1)]


def test_the_flusher_sends_a_token_held_past_the_window_during_a_long_step() -> None:
    sent = Sent()
    arrived = threading.Event()

    def write(report: RunnerReport) -> None:
        sent.append(report)
        if len(sent) == 2:
            arrived.set()

    coalescer = TokenCoalescer(write, window_s=0.02)
    flusher = coalescer.start_flusher()
    try:
        coalescer(token("a", 0))
        coalescer(token("a", 1))  # held; no step ends: only the flusher can send it
        assert arrived.wait(5.0)
        assert [e.index for e in sent if isinstance(e, TokenChunk)] == [0, 1]
    finally:
        coalescer.close()
        flusher.join(5.0)
    assert not flusher.is_alive()


def test_time_spent_reporting_is_not_engine_time() -> None:
    """A step slowed by a blocked pipe (the worker behind) keeps tokens for fuller events."""
    clock = Clock()
    sent = Sent()

    def slow_write(report: Written) -> None:
        sent.append(report)
        time.sleep(0.02)  # a full pipe: the write blocks

    coalescer = TokenCoalescer(slow_write, clock=clock)
    coalescer(token("a", 0))  # the first token: written at once, slowly
    coalescer(token("a", 1))
    coalescer.step_ended(0.021)  # almost all of it was the write
    assert [e.index for e in sent if isinstance(e, TokenChunk)] == [0]


def test_a_steps_token_events_leave_in_one_flush() -> None:
    """Token events are written unflushed and flushed once the step is reported; a report of
    another kind goes out with them (the writer's own flush), and so does a close."""
    clock = Clock()
    out: list[str] = []
    coalescer = TokenCoalescer(lambda written: out.append("token" if isinstance(
        written, bytes) else written.type), flush=lambda: out.append("flush"), clock=clock)
    for task_id in ("a", "b", "c"):  # three first tokens in one step: each written at once
        coalescer(token(task_id, 0))
    assert out == ["token"] * 3
    coalescer.step_ended(0.001)
    assert out == ["token"] * 3 + ["flush"]
    coalescer.step_ended(0.001)  # nothing new: no flush
    coalescer(token("a", 1))
    coalescer(finished("a"))  # sends a's held token, then the report flushes both
    coalescer.step_ended(0.001)
    assert out[4:] == ["token", "task_finished"]
    coalescer(token("b", 1))
    coalescer.close()
    assert out[6:] == ["token", "flush"]


def test_an_engines_plain_tokens_make_the_bytes_their_token_chunks_make() -> None:
    """Engines report plain tokens as Token tuples; the events written are the same bytes."""
    written: dict[str, list[Written]] = {"token": [], "chunk": []}
    for kind, out in written.items():
        clock = Clock()
        coalescer = TokenCoalescer(out.append, clock=clock)  # only token events here
        for index in range(1 + MAX_TOKENS + 2):
            plain = Token("a", 100.0 + index, index, 1000 + index, f" t{index}é")
            coalescer(plain if kind == "token" else plain.chunk())
            clock.now += 0.0001
            coalescer.step_ended(0.0001)
        coalescer.close()
    assert written["token"] == written["chunk"]
    assert [decode_report(w).count for w in written["token"]] == [1, MAX_TOKENS, 2]
