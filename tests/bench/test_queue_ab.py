"""The queue A/B's pure parts (bench/queue_ab.py): weight pairs and the medians of arms."""

from __future__ import annotations

from typing import Any

import pytest

from bench.queue_ab import medians
from bench.queue_fair import weight_pairs


@pytest.mark.parametrize(("text", "pairs"), [
    ("1:1", ((1.0, 1.0),)),
    ("1:1,1:2", ((1.0, 1.0), (1.0, 2.0))),
    ("2:0.5", ((2.0, 0.5),)),
])
def test_weight_pairs(text: str, pairs: tuple[tuple[float, float], ...]) -> None:
    assert weight_pairs(text) == pairs


def _run(share: float, ratio: float, alone_q: float, beside_q: float | None) -> dict[str, Any]:
    return {"weight_a": 1.0, "weight_b": 1.0, "share_b": share, "tokens_per_s": 600.0,
            "ttft_ratio": ratio, "stages_b_alone_p50_ms": {"queue": alone_q},
            "stages_b_beside_a_p50_ms": {"queue": beside_q}}


def test_medians_over_the_arms_that_finished() -> None:
    arms = [
        {"name": "new", "fair": [_run(0.46, 2.0, 10.0, 40.0)]},
        {"name": "base", "fair": [_run(0.44, 3.0, 20.0, 120.0)]},
        {"name": "new", "failed": "HTTPStatusError: 503"},
        {"name": "new", "fair": [_run(0.48, 1.0, 10.0, 20.0)]},
        {"name": "new", "fair": [_run(0.47, 1.5, 10.0, None)]},  # a stage not heard
    ]
    assert medians(arms, "new") == {"arms": 3, "1:1": {
        "runs": 3, "share_b": 0.47, "tokens_per_s": 600.0, "ttft_ratio": 1.5,
        "ttft_ratio_range": [1.0, 2.0], "ttft_met": 2, "queue_stage_extra_ms": 20.0}}
    assert medians(arms, "base")["1:1"]["queue_stage_extra_ms"] == 100.0
    assert medians([], "base") == {"arms": 0}
