"""The seam bench's pure parts: what a stored stream is judged, which token ends a seam, and a
case's summary (the sharded case's group-ready p50, the cost of a fault)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.seam import Watch, judge, summarise
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
