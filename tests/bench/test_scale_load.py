"""The scale harness's fixed per-node load (bench.scale.busy_nodes): a tenth of the nodes, at
most MAX_BUSY, and the same number of busy peers of the real worker's model at every N."""

from __future__ import annotations

import pytest

from bench.scale import MAX_BUSY, MODELS, busy_nodes


@pytest.mark.parametrize(("n", "count"), [(1, 1), (10, 1), (40, 4), (100, 10), (1000, MAX_BUSY),
                                          (3000, MAX_BUSY)])
def test_a_tenth_of_the_nodes_is_busy_at_most_max_busy(n: int, count: int) -> None:
    busy = busy_nodes(n)
    assert len(busy) == len(set(busy)) == count
    assert all(0 <= i < n for i in busy)


@pytest.mark.parametrize("n", [10, 40, 100, 1000, 3000])
def test_the_real_workers_model_has_one_busy_peer_at_every_n(n: int) -> None:
    assert [i for i in busy_nodes(n) if i % MODELS == 0] == [0]
