"""Which token events ride on their task's terminal (fleet.worker.tails), and what the worker
does with a terminal's tail on each of its paths (fleet.worker.reports)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from fleet.aio import Supervisor
from fleet.wire.codec import encode
from fleet.wire.events import ErrorChunk, ErrorReason, TaskFinished, TokenChunk
from fleet.wire.pipe import RunnerReport, RunnerStatusReport
from fleet.wire.runners import RunnerReady
from fleet.wire.token_frames import TokenFrame, token_event
from fleet.worker import state as ev
from fleet.worker.image_outputs import ImageOutputs
from fleet.worker.inbox import Inbox, RunnerReported
from fleet.worker.reports import RunnerReports
from fleet.worker.spans import TaskSpans
from fleet.worker.state import RunnerView, WorkerState
from fleet.worker.tails import MAX_TAIL_BYTES, MAX_TAIL_EVENTS, with_tails
from tests.worker.test_image_outputs import Store
from tests.worker.test_reports import Cluster, Desk, Intake, Output, Runners


def tok(task_id: str, index: int, text: str = "x") -> TokenFrame:
    return TokenFrame(task_id, index, token_event(task_id, 1.0, index, [index], text))


def end(task_id: str, status: str = "completed", **fields: Any) -> TaskFinished:
    return TaskFinished(task_id=task_id, at=2.0, status=cast(Any, status), **fields)


READY = RunnerStatusReport(status=RunnerReady())
A0, A1, A2, B0 = tok("a", 0), tok("a", 1), tok("a", 2), tok("b", 0)
END_A, END_B = end("a"), end("b")
BIG = tok("a", 3, "y" * (MAX_TAIL_BYTES - 100))


@pytest.mark.parametrize(("read", "expected"), [
    pytest.param([A0, END_A], [(END_A, (A0,))], id="one-token-task-one-message"),
    pytest.param([A0, A1, END_A], [(END_A, (A0, A1))], id="its-tokens-just-before-it"),
    pytest.param([A0], [(A0, ())], id="no-terminal-in-the-read-nothing-waits"),
    pytest.param([END_A], [(END_A, ())], id="a-terminal-alone"),
    pytest.param([A0, B0, END_A], [(A0, ()), (B0, ()), (END_A, ())],
                 id="another-tasks-token-between-keeps-them-apart"),
    pytest.param([B0, A0, END_A], [(B0, ()), (END_A, (A0,))], id="only-its-own-task"),
    pytest.param([A0, READY, END_A], [(A0, ()), (READY, ()), (END_A, ())],
                 id="a-status-between-keeps-them-apart"),
    pytest.param([A0, END_A, B0, END_B], [(END_A, (A0,)), (END_B, (B0,))], id="two-tasks"),
    pytest.param([A0, A1, A2, tok("a", 3), tok("a", 4), END_A],
                 [(A0, ()), (END_A, (A1, A2, tok("a", 3), tok("a", 4)))],
                 id=f"at-most-{MAX_TAIL_EVENTS}-the-nearest"),
    pytest.param([A0, A1, A2, BIG, END_A], [(A0, ()), (A1, ()), (A2, ()), (END_A, (BIG,))],
                 id="bounded-in-bytes"),
    pytest.param([tok("a", 0, "y" * MAX_TAIL_BYTES), END_A],
                 [(tok("a", 0, "y" * MAX_TAIL_BYTES), ()), (END_A, ())],
                 id="one-too-big-rides-not"),
])
def test_with_tails(read: list[RunnerReport | TokenFrame],
                    expected: list[tuple[object, tuple[TokenFrame, ...]]]) -> None:
    assert with_tails(read) == expected
    # Nothing lost, nothing reordered: the tails unrolled are the read.
    assert [r for report, tail in with_tails(read) for r in (*tail, report)] == read


# ---- the worker's paths for a terminal with a tail ---------------------------------------

def reports_for(desk: Desk, output: Output, owner: Supervisor) -> RunnerReports:
    async def send(runner_id: str, command: object) -> bool:
        return True

    inbox = Inbox()
    images = ImageOutputs(cast(Any, Store()), TaskSpans(), send, inbox, owner)
    return RunnerReports(
        desk, images=images, output=cast(Any, output), intake=cast(Any, Intake()),
        cluster=cast(Any, Cluster()), runners=cast(Any, Runners()), spans=TaskSpans(),
        inbox=inbox, owner=owner,
    )


def running(task_id: str, *, prefilling: bool = True) -> WorkerState:
    runner = RunnerView("run-1", "inst-1", "tiny-llm", in_flight=frozenset({task_id}),
                        prefill={task_id: 0} if prefilling else {})
    return WorkerState(node_id="n", runners={"run-1": runner})


async def test_a_completed_terminal_stores_its_tail_inside_it() -> None:
    desk, output = Desk(running("a")), Output()
    async with Supervisor("test") as owner:
        await reports_for(desk, output, owner).report(RunnerReported("run-1", END_A, (A0, A1)))
    assert output.sent == []  # no event of their own
    (how, stored), = desk.left
    assert how == "finish" and stored.last_tokens == [
        TokenChunk.model_validate_json(frame.body) for frame in (A0, A1)]
    assert encode(stored.last_tokens[0]) == A0.body  # the bytes its runner wrote
    assert stored.model_copy(update={"last_tokens": None}) == END_A


async def test_a_tails_first_output_is_marked_before_the_terminal() -> None:
    desk, output = Desk(running("a")), Output()
    seen: list[ev.StateEvent] = []
    apply = desk.apply
    desk.apply = lambda event: (seen.append(event), apply(event))[1]  # type: ignore[method-assign]
    async with Supervisor("test") as owner:
        await reports_for(desk, output, owner).report(RunnerReported("run-1", END_A, (A0,)))
    assert isinstance(seen[0], ev.FirstOutput) and seen[0].task_id == "a"


async def test_a_failed_terminal_with_words_sends_its_tail_first_then_the_error() -> None:
    desk, output = Desk(running("a")), Output()
    failed = end("a", "failed", reason=ErrorReason.INTERNAL, message="boom")
    async with Supervisor("test") as owner:
        await reports_for(desk, output, owner).report(RunnerReported("run-1", failed, (A0,)))
    assert output.sent[0] == A0 and isinstance(output.sent[1], ErrorChunk)
    assert desk.left == [("finish", failed)]  # without a tail: its tokens went before


async def test_a_terminal_cut_short_sends_its_tail_alone_and_hands_the_task_back() -> None:
    desk, output = Desk(running("a")), Output()
    cancelled = end("a", "cancelled")
    async with Supervisor("test") as owner:
        await reports_for(desk, output, owner).report(RunnerReported("run-1", cancelled, (A0,)))
    assert output.sent == [A0]
    assert [how for how, _ in desk.left] == ["hand_back"]


async def test_a_fenced_task_sends_its_tail_as_before_and_gives_up() -> None:
    desk, output = Desk(running("a")), Output()
    desk.apply(ev.CancelNoted("a", ev.CancelOrigin.FENCED))
    async with Supervisor("test") as owner:
        await reports_for(desk, output, owner).report(RunnerReported("run-1", END_A, (A0,)))
    assert output.sent == [A0]  # refused by the fence, as when it came alone
    assert desk.left == [("give_up", "a")]
