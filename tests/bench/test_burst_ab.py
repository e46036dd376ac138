"""The burst A/B's pure parts (bench/burst_ab.py): a path's summary, and each against the peer."""

from __future__ import annotations

import pytest

from bench.burst_ab import PathSamples, against_peer


def test_a_path_summary_takes_medians_of_its_bursts() -> None:
    samples = PathSamples(burst_ttft_s=[1.0, 1.0, 2.0, 2.0, 2.0], aggregates=[60.0, 50.0, 70.0],
                          single_ttft_s=[0.3, 0.5, 0.4], bursts=[[1.0, 2.0]])
    assert samples.summary() == {"ttft_p50_s": 2.0, "aggregate_tok_s": 60.0,
                                 "single_ttft_p50_s": 0.4, "bursts": [[1.0, 2.0]]}


def test_each_path_is_read_against_the_peer() -> None:
    row = {"ttft_p50_s": 1.0, "aggregate_tok_s": 60.0, "single_ttft_p50_s": 0.3}
    rows = against_peer({"peer": row, "new_nats": {
        "ttft_p50_s": 0.9, "aggregate_tok_s": 63.0, "single_ttft_p50_s": 0.33}})
    assert rows["peer"]["vs_peer"] == {"ttft_p50": 1.0, "aggregate": 1.0, "single_ttft_p50": 1.0}
    assert rows["new_nats"]["vs_peer"] == pytest.approx(
        {"ttft_p50": 0.9, "aggregate": 1.05, "single_ttft_p50": 1.1})
