"""How a burst of prompts onto an idle text engine is read: a first group, then the rest."""

from __future__ import annotations

import pytest

from fleet.runner.burst_split import first_group, prompts_to_start


@pytest.mark.parametrize(
    ("queued", "expected"),
    [
        (0, 0),
        (1, 1),  # alone: nothing to split
        (2, 2),  # two: a step's fixed costs outweigh what the first would gain
        (3, 2),
        (4, 3),
        (8, 5),  # issue 23's burst of eight: the median request is in the first group
        (16, 9),
    ],
)
def test_the_first_group_holds_just_over_half(queued: int, expected: int) -> None:
    assert first_group(queued) == expected


@pytest.mark.parametrize(
    ("queued", "resumed", "reading", "group_waiting", "held", "limit", "expected"),
    [
        (8, 0, 0, 0, 0, 8, 5),  # a burst onto an idle engine: the first group
        (3, 0, 0, 5, 3, 8, 0),  # the rest wait for the first group's first tokens
        (3, 0, 0, 0, 3, 8, 3),  # then start together, not split again
        (4, 0, 0, 0, 3, 8, 4),  # with a newcomer behind them
        (3, 0, 0, 0, 0, 8, 2),  # three new prompts of their own are a burst
        (2, 0, 0, 0, 0, 8, 2),  # a small burst is read whole
        (1, 0, 0, 0, 0, 8, 1),
        (0, 0, 0, 0, 0, 8, 0),
        (8, 1, 0, 0, 0, 8, 5),  # a lone task that had started goes first, then 4 of the 7 new
        (3, 1, 0, 0, 0, 8, 3),  # with 2 new: all
        (1, 1, 0, 0, 0, 8, 1),
        (4, 0, 2, 0, 0, 8, 4),  # arrivals while others are read: all, as before the split
        (12, 0, 2, 0, 0, 8, 6),  # never more than the prefill batch size at once
        (4, 0, 8, 0, 0, 8, 0),
        (16, 0, 0, 0, 0, 8, 8),  # a first group larger than the bound: the bound
        (16, 0, 0, 0, 8, 8, 8),  # the rest of a burst larger than the bound: the bound
    ],
)
def test_prompts_to_start(
    queued: int, resumed: int, reading: int, group_waiting: int, held: int, limit: int,
    expected: int,
) -> None:
    assert prompts_to_start(
        queued=queued, resumed=resumed, reading=reading, group_waiting=group_waiting,
        held=held, limit=limit,
    ) == expected
