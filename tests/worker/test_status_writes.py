"""The runner status writer skips a Running record that a newer busy/idle record of the same
runner has superseded before it was written (issue 23); every other record is written."""

from __future__ import annotations

import pytest

from fleet.wire.cluster import RunnerRecord
from fleet.wire.runners import (
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShuttingDown,
    RunnerStatus,
    RunnerWarmingUp,
)
from fleet.worker.cluster import superseded


def record(status: RunnerStatus, active: int = 0) -> RunnerRecord:
    return RunnerRecord(runner_id="r1", instance_id="i1", node_id="n1", model="m",
                        status=status, active_tasks=active, at=1.0)


RUNNING = record(RunnerRunning(active_tasks=3), 3)
READY = record(RunnerReady())


@pytest.mark.parametrize(
    ("older", "newest", "skipped"),
    [
        (RUNNING, record(RunnerRunning(active_tasks=4), 4), True),  # a busier one replaces it
        (RUNNING, READY, True),  # all done since: the Ready says so
        (RUNNING, RUNNING, False),  # it is the newest: written
        (RUNNING, None, False),  # its runner's removal follows: written, then removed
        (READY, RUNNING, False),  # every Ready is written (a waiter may watch for it)
        (READY, record(RunnerReady()), False),
        (RUNNING, record(RunnerShuttingDown()), False),  # lifecycle follows: all in order
        (record(RunnerWarmingUp()), READY, False),
        (record(RunnerLoading(layers_done=1)), record(RunnerLoading(layers_done=2)), False),
        (record(RunnerFailed(error="x")), READY, False),
        (None, READY, False),  # a removal is always written
    ],
)
def test_superseded(older: RunnerRecord | None, newest: RunnerRecord | None,
                    skipped: bool) -> None:
    assert superseded(older, newest) is skipped
