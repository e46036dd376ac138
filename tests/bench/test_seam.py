"""The seam bench's pure parts: what a stored stream is judged, which token ends a seam, and a
case's summary (the sharded case's group-ready p50, the cost of a fault)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.seam import Watch, judge, measured, summarise
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk


def accepted(attempt: int) -> TaskAccepted:
    return TaskAccepted(task_id="t", at=0, model="m", node_id="n", runner_id="r",
                        attempt=attempt)


def tokens(first: int, count: int) -> TokenChunk:
    return TokenChunk(task_id="t", at=0, index=first, token_id=1, text="x" * count,
                      token_ids=[1] * count if count > 1 else None)


def done() -> TaskFinished:
    return TaskFinished(task_id="t", at=0, status="completed")


@pytest.mark.parametrize(
    ("events", "verdict"),
    [
        ([accepted(0), tokens(0, 4), done()],
         {"gaps": 0, "duplicates": 0, "lost": 0, "terminals": 1}),
        ([accepted(0), tokens(0, 2), accepted(1), tokens(2, 2), done()],
         {"gaps": 0, "duplicates": 0, "lost": 0, "terminals": 1}),
        ([accepted(0), tokens(0, 3), accepted(1), tokens(2, 2), done()],  # index 2 twice
         {"gaps": 0, "duplicates": 1, "lost": 0, "terminals": 1}),
        ([accepted(0), tokens(0, 1), tokens(2, 2), done()],  # index 1 missing
         {"gaps": 1, "duplicates": 0, "lost": 1, "terminals": 1}),
        ([accepted(0), tokens(0, 4)], {"gaps": 0, "duplicates": 0, "lost": 1, "terminals": 0}),
    ],
)
def test_judge(events: list[OutputEvent], verdict: dict[str, int]) -> None:
    assert judge(events, max_tokens=4) == verdict


def test_the_seam_ends_at_the_first_token_of_a_later_attempt() -> None:
    watch = Watch()
    # (arrival, event): the killed attempt's last token lands after the fault (in flight).
    watch.events = [(1.0, accepted(0)), (2.0, tokens(0, 3)), (3.5, tokens(3, 1)),
                    (4.0, accepted(1)), (5.0, tokens(3, 1))]
    assert watch.next_token_after(3.0) == 5.0
    assert watch.next_token_any_after(3.0) == 3.5


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"seam_s": 2.0, "gaps": 0, "duplicates": 0, "lost": 0},
          {"seam_s": 4.0, "gaps": 0, "duplicates": 0, "lost": 0},
          {"error": "TimeoutError: x"}],
         {"rounds": 3, "p50_s": 3.0, "per_fault_s": 10.0, "errors": ["TimeoutError: x"]}),
        ([{"seam_s": 9.0, "group_ready_s": 8.0, "rank": 0},
          {"seam_s": 5.0, "group_ready_s": 4.0, "rank": 1}],
         {"p50_s": 7.0, "group_ready_p50_s": 6.0, "per_fault_s": 15.0}),
        ([{"seam_s": 3.0, "spare_ready_s": 2.5}],
         {"spare_ready_p50_s": 2.5, "over_spare_ready_p50_s": 0.5}),
    ],
)
def test_summarise(rows: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    summary = summarise(rows, elapsed_s=30.0)
    assert {key: summary[key] for key in expected} == expected
    assert ("group_ready_p50_s" in summary) == any("group_ready_s" in r for r in rows)


async def test_a_round_done_before_its_fault_is_run_again_with_its_index() -> None:
    """Rounds 0 and 2 measured nothing once each (their answer was done before the fault):
    each is run again with the same index (its rank), and the case has its 3 measured rounds
    and both re-runs, marked."""
    outcomes = iter([{"seam_s": 1.0}, {"rerun": "finished before the fault"}, {"seam_s": 2.0},
                     {"rerun": "made whole before the fault"}, {"seam_s": 3.0}])
    asked: list[int] = []

    async def one(index: int) -> dict[str, Any]:
        asked.append(index)
        return next(outcomes)

    async def broke() -> None:
        raise AssertionError("no round broke")

    rows = await measured(3, one, broke)
    assert asked == [0, 1, 1, 2, 2]
    summary = summarise(rows)
    assert (summary["rounds"], summary["reruns"], summary["p50_s"]) == (3, 2, 2.0)
    assert summary["rerun_why"] == ["finished before the fault", "made whole before the fault"]


async def test_re_runs_are_bounded() -> None:
    """An answer always done before its fault: `rounds` re-runs, then an error a round."""
    calls = 0

    async def one(index: int) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"rerun": "finished before the fault"}

    async def broke() -> None:
        pass

    rows = await measured(2, one, broke)
    assert calls == 4
    summary = summarise(rows)
    assert (summary["rounds"], summary["reruns"]) == (2, 2)
    assert summary["errors"] == ["finished before the fault"] * 2


def test_an_ending_says_how_far_the_client_was_behind_the_answer() -> None:
    watch = Watch()
    made = [TokenChunk(task_id="t", at=100.0 + k * 0.01, index=k, token_id=1, text="x")
            for k in range(3)]
    watch.events = [(1.0, accepted(0)), *((2.0, e) for e in made),
                    (3.0, TaskFinished(task_id="t", at=100.03, status="completed",
                                       finish_reason="length"))]
    watch.walls = [100.0, 100.3, 100.3, 100.3, 100.3]  # all seen at once, 0.3 s after
    ending = watch.ending()
    assert ending["tokens"] == 3 and ending["finish_reason"] == "length"
    assert (ending["chunks"], ending["made_s"], ending["behind_s"]) == (3, 0.02, 0.3)
