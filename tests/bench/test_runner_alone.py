"""The single-stream decomposition's pure parts (bench/runner_alone.py)."""

from __future__ import annotations

import pytest

from bench.runner_alone import Decode, PathRuns, against_limit, decode_of


def test_a_decode_counts_the_tokens_after_the_first_over_their_time() -> None:
    assert decode_of(101, 2.0, 3.0) == Decode(100.0)


def test_a_runner_decode_gives_its_cpu_a_token_and_the_cores_it_used() -> None:
    decode = decode_of(101, 2.0, 4.0, cpu_s=2.5)
    assert decode.tok_s == pytest.approx(50.0)
    assert decode.cpu_ms_per_token == pytest.approx(25.0)
    assert decode.cores == pytest.approx(1.25)


@pytest.mark.parametrize(("tokens", "first", "last"), [(1, 2.0, 3.0), (10, 2.0, 2.0)])
def test_a_stream_without_a_decode_is_refused(tokens: int, first: float, last: float) -> None:
    with pytest.raises(ValueError, match="no decode"):
        decode_of(tokens, first, last)


def test_a_path_summary_takes_medians_and_keeps_every_run() -> None:
    runner = PathRuns([Decode(150.0, 7.0, 1.3), Decode(170.0, 6.0, 1.2), Decode(160.0, 8.0, 1.1)])
    assert runner.summary() == {"decode_tok_s": 160.0, "runs": [150.0, 170.0, 160.0],
                                "runner_cpu_ms_per_token": 7.0, "runner_cores": 1.2}
    assert PathRuns([Decode(100.0), Decode(120.0)]).summary() == {
        "decode_tok_s": 110.0, "runs": [100.0, 120.0]}


def test_each_path_is_read_against_the_limit() -> None:
    rows = against_limit({"limit": {"decode_tok_s": 200.0}, "fleet_nats": {"decode_tok_s": 150.0}})
    assert rows["limit"]["vs_limit"] == 1.0
    assert rows["fleet_nats"]["vs_limit"] == pytest.approx(0.75)
