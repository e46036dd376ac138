"""`decide`: what a redelivered (or runner-crashed) task with stored output needs. Table tests."""

from __future__ import annotations

import pytest

from fleet.wire.events import (
    ErrorReason,
    ImageChunk,
    OutputEvent,
    TaskAccepted,
    TokenChunk,
    failed,
)
from fleet.wire.ring import RING_LOST_EXIT
from fleet.wire.tasks import ImageGeneration, TextGeneration
from fleet.worker.continuation import (
    ContinuationBook,
    Continue,
    CrashFate,
    CrashRoute,
    GiveUp,
    crash_fate,
    crash_route,
    decide,
    exit_continues_all,
    generated_tokens,
    with_seed,
)
from fleet.worker.state import PendingTask

T = "t1"


def accepted(
    delivery: int = 1, attempt: int = 0, seed: int | None = None, node: str = "n"
) -> TaskAccepted:
    return TaskAccepted(
        task_id=T, at=1.0, model="m", node_id=node, runner_id="r", delivery=delivery,
        attempt=attempt, seed=seed,
    )


def token(index: int, token_id: int | None = None) -> TokenChunk:
    return TokenChunk(task_id=T, at=1.0, index=index, token_id=token_id or 100 + index, text="x")


def image(index: int, partial: int | None) -> ImageChunk:
    return ImageChunk(task_id=T, at=1.0, image_index=index, partial_index=partial,
                      format="png", width=1, height=1, size_bytes=1, sha256="0" * 64)


def text(max_continuations: int = 3) -> TextGeneration:
    return TextGeneration(task_id=T, model="m", prompt="p", max_continuations=max_continuations)


IMAGE = ImageGeneration(task_id=T, model="m", prompt="p")


@pytest.mark.parametrize(("task", "events", "expected"), [
    (text(), [accepted(), token(0), token(1)], Continue((100, 101), 1, moved_from="n")),
    (text(), [accepted(), token(0), accepted(2, 1, node="n2"), token(1)],
     Continue((100, 101), 2, moved_from="n2")),
    (text(), [accepted(), token(0), accepted(2, 1), accepted(3, 2), accepted(4, 3), token(1)],
     GiveUp),
    (text(max_continuations=0), [accepted(), token(0)], GiveUp),
    (text(), [accepted(), token(0), failed(T, 1.0, ErrorReason.WORKER_LOST, "x")], None),
    (IMAGE, [accepted(), image(0, 0), image(0, None), image(1, 0)],
     Continue((), 1, frozenset({"0.0", "0.final", "1.0"}), moved_from="n")),
    (text(), [accepted(), image(0, 0)], GiveUp),
    # The seed the first attempt sampled with goes to every continuation.
    (text(), [accepted(seed=42), token(0)], Continue((100,), 1, seed=42, moved_from="n")),
    (text(), [accepted(seed=42), token(0), accepted(2, 1, seed=42), token(1)],
     Continue((100, 101), 2, seed=42, moved_from="n")),
])
def test_decide(task: object, events: list[OutputEvent], expected: object) -> None:
    got = decide(task, events)  # type: ignore[arg-type]
    if expected is GiveUp:
        assert isinstance(got, GiveUp)
    else:
        assert got == expected


@pytest.mark.parametrize(("indexes", "expected"), [
    ([], ()),
    ([0, 1, 2], (100, 101, 102)),
    ([0, 1, 3], (100, 101)),  # a gap: only what a reader in order has seen
    ([0, 1, 1, 2], (100, 101, 102)),  # a token stored twice counts once
    ([1, 2], ()),
])
def test_generated_tokens_are_the_contiguous_run_from_zero(
    indexes: list[int], expected: tuple[int, ...]
) -> None:
    assert generated_tokens([token(i) for i in indexes]) == expected


def test_the_book_hands_a_continuation_to_its_next_dispatch_once() -> None:
    book = ContinuationBook()
    pending = PendingTask(task=text(), received_at=0.0)
    book.queued[T] = Continue((1, 2), 1)
    assert book.dispatched(pending) == Continue((1, 2), 1)
    assert book.running[T] is pending
    assert book.dispatched(pending) == Continue((), 0)
    book.released(T)
    assert T not in book.running and T not in book.queued


SAMPLED = TextGeneration(task_id=T, model="m", prompt="p", temperature=0.8)


@pytest.mark.parametrize(("task", "recorded", "expected_seed"), [
    (SAMPLED, 42, 42),  # a continuation samples with the recorded seed
    (SAMPLED.model_copy(update={"seed": 7}), 42, 7),  # the request's own seed stays
    (SAMPLED.model_copy(update={"temperature": 0.0}), 42, None),  # greedy needs none
    (IMAGE, 42, None),  # an image task derives its seed from its id (fleet.runner.image)
])
def test_with_seed(task: object, recorded: int | None, expected_seed: int | None) -> None:
    assert with_seed(task, recorded).seed == expected_seed  # type: ignore[arg-type]


def test_a_first_attempt_without_a_seed_gets_a_fresh_one_fixed() -> None:
    seeds = {with_seed(SAMPLED, None).seed for _ in range(20)}
    assert None not in seeds and len(seeds) == 20
    assert SAMPLED.seed is None  # the held task is not changed


@pytest.mark.parametrize(("terminal_waiting", "held", "fate"), [
    (True, True, CrashFate.ENDING),  # finished at its runner, images uploading: not rerun
    (True, False, CrashFate.ENDING),
    (False, True, CrashFate.READ_BACK),
    (False, False, CrashFate.CRASHED),
])
def test_crash_fate(terminal_waiting: bool, held: bool, fate: CrashFate) -> None:
    assert crash_fate(terminal_waiting=terminal_waiting, held_for_continuation=held) is fate


@pytest.mark.parametrize(("text", "ready_here", "route"), [
    (True, False, CrashRoute.HAND_BACK),  # another node's ready runner beats a model load
    (True, True, CrashRoute.HERE),  # another runner of the model is ready here
    (False, False, CrashRoute.HERE),  # an image task: its images may be uploading from here
    (False, True, CrashRoute.HERE),
])
def test_crash_route(text: bool, ready_here: bool, route: CrashRoute) -> None:
    assert crash_route(text=text, runner_ready_here=ready_here) is route


@pytest.mark.parametrize(("returncode", "continues"), [
    (RING_LOST_EXIT, True),  # a peer rank died: every task goes on, streaming or not
    (1, False),  # the runner failed: a task not yet streaming may be the cause
    (-9, False),  # SIGKILLed (an OOM kill, an operator)
    (0, False),  # a clean exit with tasks in flight: each streams on only if it began
])
def test_exit_continues_all(returncode: int, continues: bool) -> None:
    assert exit_continues_all(returncode) is continues
