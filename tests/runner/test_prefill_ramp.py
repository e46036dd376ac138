"""The ramp a lone task reads its prompt in when more tasks are likely to follow."""

from __future__ import annotations

import pytest

from fleet.runner.prefill_ramp import chunk_tokens, expects_company


@pytest.mark.parametrize(
    ("peak_width", "expected"),
    [
        (0, False),  # a fresh engine: nothing said anything about the traffic
        (1, False),  # one stream at a time: read the prompt whole
        (2, True),
        (32, True),
    ],
)
def test_company_is_expected_after_tasks_ran_together(peak_width: int, expected: bool) -> None:
    assert expects_company(peak_width) is expected


@pytest.mark.parametrize(
    ("read", "first", "limit", "expected"),
    [
        (0, 16, 2048, 16),  # the first chunk
        (16, 16, 2048, 16),  # then as much as already read: doubling
        (32, 16, 2048, 32),
        (64, 16, 2048, 64),
        (1000, 16, 2048, 1000),
        (3000, 16, 2048, 2048),  # never past the engine's prefill step
        (0, 2048, 2048, 2048),  # no ramp: steps of the prefill step from the start
        (4096, 2048, 2048, 2048),
        (0, 0, 2048, 1),  # always progress
    ],
)
def test_chunks_double_from_the_first_up_to_the_limit(
    read: int, first: int, limit: int, expected: int
) -> None:
    assert chunk_tokens(read, first, limit) == expected


def test_the_ramp_reads_a_prompt_in_few_steps() -> None:
    read, steps = 0, 0
    while read < 200:
        read += min(200 - read, chunk_tokens(read, 16, 2048))
        steps += 1
    assert steps == 5  # 16, 16, 32, 64, 72: log2 of the prompt over the first chunk, not 13
