"""The fault count is a pure function of stored events: a table of event histories."""

from __future__ import annotations

import pytest

from fleet.wire.events import ErrorReason, TaskAccepted, TaskFinished, TokenChunk, Usage, failed
from tests.faults.tally import Stored, history, longest_silence, tally

T0 = 1000.0  # the broker's return


def accepted(task: str) -> Stored:
    return Stored(TaskAccepted(task_id=task, at=T0, model="m", node_id="n", runner_id="r"), T0)


def continued(task: str, resumed: int) -> Stored:
    return Stored(TaskAccepted(task_id=task, at=T0, model="m", node_id="n", runner_id="r",
                               attempt=1, delivery=2, continued_from=resumed), T0)


def token(task: str, index: int) -> Stored:
    return Stored(TokenChunk(task_id=task, at=T0, index=index, token_id=index, text="x"), T0)


def done(task: str, tokens: int = 3, at: float = T0 + 1) -> Stored:
    usage = Usage(completion_tokens=tokens)
    return Stored(TaskFinished(task_id=task, at=at, status="completed", usage=usage), at)


def ended(task: str, reason: ErrorReason) -> Stored:
    return Stored(failed(task, T0 + 1, reason, "x"), T0 + 1)


def whole(task: str) -> list[Stored]:
    return [accepted(task), token(task, 0), token(task, 1), token(task, 2)]


CASES = [
    ("clean", [*whole("a"), done("a")], {"completed": 1}),
    ("no events at all", [], {"lost": 1}),
    ("accepted, never ended", [accepted("a"), token("a", 0)], {"hung": 1}),
    ("two terminals", [*whole("a"), done("a"), done("a")],
     {"completed": 1, "duplicate_terminals": 1}),
    ("a missing token", [accepted("a"), token("a", 0), token("a", 2), done("a")],
     {"completed": 1, "completed_with_gap": 1}),
    ("usage says more than stored", [*whole("a"), done("a", tokens=4)],
     {"completed": 1, "completed_with_gap": 1}),
    ("a token twice", [*whole("a"), token("a", 2), done("a")],
     {"completed": 1, "duplicate_tokens": 1}),
    ("cancelled by nobody", [accepted("a"), ended("a", ErrorReason.CANCELLED)],
     {"spurious_cancelled": 1}),
    ("worker lost: allowed", [accepted("a"), ended("a", ErrorReason.WORKER_LOST)],
     {"worker_lost": 1}),
    ("runner crashed: allowed", [accepted("a"), ended("a", ErrorReason.RUNNER_CRASHED)],
     {"runner_crashed": 1}),
    ("output lost: allowed", [accepted("a"), token("a", 0), ended("a", ErrorReason.OUTPUT_LOST)],
     {"output_lost": 1}),
    ("output lost, though all of it was stored",
     [*whole("a"), ended("a", ErrorReason.OUTPUT_LOST)],
     {"output_lost": 1, "output_lost_but_whole": 1}),
    ("tokens stored out of order", [accepted("a"), token("a", 1), token("a", 0), token("a", 2),
                                    done("a")], {"completed": 1, "tokens_out_of_order": 1}),
    ("tokens after the terminal",
     [accepted("a"), token("a", 0), ended("a", ErrorReason.WORKER_LOST), token("a", 1)],
     {"worker_lost": 1, "output_after_terminal": 1}),
    ("a continuation from the hole at 1 supersedes the 2 stored past it: no duplicate",
     [accepted("a"), token("a", 0), token("a", 2), continued("a", 1), token("a", 1),
      token("a", 2), done("a")],
     {"completed": 1, "tokens_out_of_order": 1, "tokens_superseded": 1}),
    ("a continuation stores an index below where it resumed",
     [*whole("a"), continued("a", 2), token("a", 1), done("a")],
     {"completed": 1, "tokens_out_of_order": 1, "duplicate_tokens": 1}),
    ("failed otherwise", [ended("a", ErrorReason.INTERNAL)], {"other_failed": 1}),
    ("ended after the deadline", [*whole("a"), done("a", at=T0 + 61)], {"completed": 1, "late": 1}),
]


@pytest.mark.parametrize(("events", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_tally(events: list[Stored], want: dict[str, int]) -> None:
    counts = tally({"a": 3}, {"a": events}, returned_at=T0)
    fields = ("completed", "lost", "hung", "late", "duplicate_terminals", "completed_with_gap",
              "duplicate_tokens", "spurious_cancelled", "worker_lost", "runner_crashed",
              "output_lost", "other_failed", "output_lost_but_whole", "tokens_out_of_order",
              "output_after_terminal", "tokens_superseded")
    assert {f: getattr(counts, f) for f in fields if getattr(counts, f)} == want
    assert counts.tasks == 1


def test_bad_lists_only_what_the_bar_forbids() -> None:
    counts = tally(
        {"a": 3, "b": 3}, {"a": [accepted("a"), ended("a", ErrorReason.WORKER_LOST)]},
        returned_at=T0,
    )
    assert counts.bad == {"lost": 1}  # b never ran; a's worker_lost is allowed
    assert counts.examples["lost"] == ["b"]


def test_history_folds_token_runs_and_times_the_end_from_the_return() -> None:
    events = [accepted("a"), token("a", 0), token("a", 1), token("a", 3), done("a")]
    assert history(events, T0) == "accepted n d1; tok 0-1; tok 3; completed/None @+1.0s"


@pytest.mark.parametrize(("arrivals", "ended", "silence"), [
    ({"a": [0.0, 1.0, 2.0, 3.0]}, {"a"}, 1.0),  # steady
    ({"a": [0.0, 1.0, 6.0]}, {"a"}, 5.0),  # quiet from 1 to 6
    ({"a": [0.0, 9.0]}, {"a"}, 8.0),  # the gap is cut to the window [1, 10]... from 1 to 9
    ({"a": [0.0, 0.5]}, set(), 9.0),  # still running, silent from the window's start to its end
    ({"a": [0.0, 0.5]}, {"a"}, 0.0),  # ended before the window: not a running stream
    ({"a": [2.0, 3.0], "b": [1.0, 7.0]}, {"a", "b"}, 6.0),  # the worst task counts
    ({"a": [12.0, 13.0]}, set(), 0.0),  # started after the window
])
def test_longest_silence(
    arrivals: dict[str, list[float]], ended: set[str], silence: float
) -> None:
    assert longest_silence(arrivals, ended, 1.0, 10.0) == pytest.approx(silence)
