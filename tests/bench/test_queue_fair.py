"""The queue bench's fairness arithmetic (bench/queue_fair.py), as tables."""

from __future__ import annotations

import pytest

from bench.queue_fair import Served, Stages, b_clients, stage_p50s_ms, tokens_in, ttft_p50_ms


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
