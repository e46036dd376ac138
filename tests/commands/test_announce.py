"""`fleet up` says once when each runner becomes ready, and when one fails."""

from __future__ import annotations

import pytest

from fleet.commands.announce import runner_news
from fleet.wire.cluster import RunnerRecord
from fleet.wire.runners import RunnerFailed, RunnerLoading, RunnerReady, RunnerRunning


def record(status: object, runner_id: str = "r1") -> RunnerRecord:
    return RunnerRecord(runner_id=runner_id, instance_id="i", node_id="n", model="m",
                        status=status, at=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("told", "status", "expected", "told_after"),
    [
        ({}, RunnerLoading(), None, {}),
        ({}, RunnerReady(), "fleet up: runner r1 for m on node n is ready", {"r1": "ready"}),
        ({}, RunnerRunning(), "fleet up: runner r1 for m on node n is ready", {"r1": "ready"}),
        ({"r1": "ready"}, RunnerRunning(), None, {"r1": "ready"}),
        ({"r1": "ready"}, RunnerReady(), None, {"r1": "ready"}),
        ({"r1": "ready"}, RunnerFailed(error="oom"),
         "fleet up: runner r1 for m on node n failed: oom", {"r1": "failed"}),
        ({"r1": "failed"}, RunnerReady(), "fleet up: runner r1 for m on node n is ready",
         {"r1": "ready"}),
    ],
)
def test_runner_news(
    told: dict[str, str], status: object, expected: str | None, told_after: dict[str, str]
) -> None:
    told = dict(told)
    assert runner_news(record(status), told) == expected
    assert told == told_after
