"""The queue bench's fairness arithmetic (bench/queue_fair.py), as tables."""

from __future__ import annotations

import pytest

from bench.queue_fair import (
    FairPlan,
    Served,
    Stages,
    b_clients,
    b_waits,
    cells_of,
    fair_summary,
    stage_p50s_ms,
    tokens_in,
    ttft_p50_ms,
)


@pytest.mark.parametrize(("served", "window", "tokens"), [
    ([Served(0.0, 1.0, 3.0, 10)], (0.0, 10.0), 10.0),  # wholly inside
    ([Served(0.0, 1.0, 3.0, 10)], (2.0, 10.0), 5.0),  # its second half
    ([Served(0.0, 1.0, 3.0, 10)], (3.0, 10.0), 0.0),  # ended as the window opens
    ([Served(0.0, None, 3.0, 0)], (0.0, 10.0), 0.0),  # no token came
    ([Served(0.0, 2.0, 2.0, 4)], (1.0, 3.0), 4.0),  # all at once, inside
    ([Served(0.0, 2.0, 2.0, 4)], (2.5, 3.0), 0.0),  # all at once, before
    ([Served(0.0, 1.0, 2.0, 10), Served(0.0, 1.5, 2.5, 10)], (1.5, 2.0), 10.0),
])
def test_tokens_in_a_window(served: list[Served], window: tuple[float, float],
                            tokens: float) -> None:
    assert tokens_in(served, *window) == pytest.approx(tokens)


@pytest.mark.parametrize(("served", "p50"), [
    ([Served(1.0, 1.1, 2.0, 1), Served(2.0, 2.3, 3.0, 1), Served(9.0, 9.5, 10.0, 1)], 200.0),
    ([Served(1.0, None, 2.0, 0)], None),  # sent in the window, no first token
    ([], None),
])
def test_ttft_of_requests_sent_in_the_window(served: list[Served], p50: float | None) -> None:
    assert ttft_p50_ms(served, 0.0, 5.0) == p50


@pytest.mark.parametrize(("slots", "weights", "clients"), [
    (16, (1.0, 1.0), 8),
    (16, (1.0, 2.0), 11),  # 10.67: rounded up, so B asks at least its share
    (16, (3.0, 1.0), 4),
    (1, (10.0, 1.0), 1),
])
def test_b_keeps_its_weight_share_of_the_slots_going(
    slots: int, weights: tuple[float, float], clients: int,
) -> None:
    assert b_clients(slots, *weights) == clients


def test_stages_split_the_first_token_where_the_worker_published_it() -> None:
    stages = Stages()
    stages.published = {"t1": 1.010, "t2": 2.010, "t3": 3.010}
    stages.accepted = {"t1": 1.020, "t2": 2.030, "t3": 3.020}
    stages.first_out = {"t1": 1.025, "t2": 2.040}  # t3's first token not heard on NATS
    served = [Served(1.0, 1.030, 1.5, 5, "t1"), Served(2.0, 2.050, 2.5, 5, "t2"),
              Served(3.0, 3.040, 3.5, 5, "t3")]
    p50s = stage_p50s_ms(served, stages, 0.0, 10.0)
    assert p50s == {"admission": 10.0, "queue": 10.0, "first_token": 20.0, "on_lane": 0.0,
                    "runner": 7.5, "relay": 7.5}


def test_rounds_interleave_the_weight_pairs() -> None:
    plan = FairPlan(weights=((1.0, 1.0), (1.0, 2.0)), rounds=2)
    assert cells_of(plan) == [(1.0, 1.0), (1.0, 2.0), (1.0, 1.0), (1.0, 2.0)]


def test_what_b_waited_behind() -> None:
    stages = Stages()
    # b1 published while a1 sat in the broker, and a1 started before it: its wait was A's.
    # b2 published with nothing of A's queued, into a full fleet (2 slots: a2, b1 running).
    stages.published = {"a1": 1.000, "b1": 1.010, "a2": 1.500, "b2": 2.000}
    stages.accepted = {"a1": 1.020, "b1": 1.030, "a2": 1.510, "b2": 2.100}
    a = [Served(0.99, 1.1, 1.9, 5, "a1"), Served(1.49, 1.6, 3.0, 5, "a2")]
    b = [Served(1.0, 1.1, 2.5, 5, "b1"), Served(1.99, 2.2, 3.0, 5, "b2"),
         Served(9.0, None, 9.1, 0, "b-not-heard")]
    assert b_waits(b, a, stages, 0.0, 5.0, slots=2) == {
        "a_queued_ahead": 0.5, "a_started_meanwhile": 0.5, "full_at_publish": 0.5,
        "queue_p50_a_ahead_ms": 20.0, "queue_p50_none_ahead_ms": 100.0,
        "admission_p90_ms": 10.0, "queue_p90_ms": 100.0}
    assert b_waits(b, a, stages, 5.0, 6.0, slots=2) == {}


def _run(ratio: float | None, share: float, pair: tuple[float, float] = (1.0, 1.0)) -> dict:
    return {"weight_a": pair[0], "weight_b": pair[1], "share_b": share, "ttft_ratio": ratio,
            "stages_b_beside_a_p50_ms": {"queue": 20.0}, "stages_b_alone_p50_ms": {"queue": 6.0},
            "b_waits": {"a_queued_ahead": 0.1}}


def test_summary_over_rounds_shows_the_high_ones() -> None:
    runs = [_run(1.1, 0.48), _run(1.2, 0.65, (1.0, 2.0)), _run(1.7, 0.47), _run(None, 0.49),
            _run(1.0, 0.5)]
    summary = fair_summary(runs)
    assert summary["1:1"] == {
        "rounds": 4, "share_b": [0.485, 0.47, 0.5], "ttft_ratio": [1.1, 1.0, 1.7],
        "met_ttft": 2, "high": [{"run": 2, "ttft_ratio": 1.7,
                                 "stages_b_beside_a_p50_ms": {"queue": 20.0},
                                 "stages_b_alone_p50_ms": {"queue": 6.0},
                                 "b_waits": {"a_queued_ahead": 0.1}}]}
    assert summary["1:2"]["rounds"] == 1 and summary["1:2"]["high"] == []
