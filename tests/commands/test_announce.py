"""`fleet up` says once when each runner becomes ready, and when one fails."""

from __future__ import annotations

import asyncio
import io
import time

import pytest

from fleet.commands.announce import announce_own_runners, progress_bar, runner_news, status_text
from fleet.wire.cluster import RunnerRecord
from fleet.wire.runners import (
    RunnerDownloading,
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
)

MB = 1_000_000


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


@pytest.mark.parametrize(
    ("done", "total", "bar"),
    [
        (0, 540 * MB, "[--------------------]   0% 0/540 MB"),
        (162 * MB, 540 * MB, "[######--------------]  30% 162/540 MB"),
        (540 * MB, 540 * MB, "[####################] 100% 540/540 MB"),
        (0, 0, "[####################] 100% 0/0 MB"),  # nothing to fetch
    ],
)
def test_progress_bar(done: int, total: int, bar: str) -> None:
    assert progress_bar(done, total) == bar


def test_a_download_is_told_at_its_start_and_every_ten_percent() -> None:
    told: dict[str, str] = {}
    lines = [
        runner_news(record(RunnerDownloading(bytes_done=done, bytes_total=100 * MB)), told)
        for done in (0, 3 * MB, 9 * MB, 10 * MB, 55 * MB, 59 * MB, 100 * MB)
    ]
    said = [line for line in lines if line]
    assert len(said) == 4  # 0%, 10%, 50%, 100%
    assert said[0] == ("fleet up: node n fetching m from the fleet "
                       "[--------------------]   0% 0/100 MB")
    assert said[-1].endswith("100% 100/100 MB")
    # The runner that follows the download is told as before.
    assert runner_news(record(RunnerReady(), "r2"), told) == (
        "fleet up: runner r2 for m on node n is ready"
    )


async def test_a_worker_tells_its_own_runners_from_its_records_once_each() -> None:
    # Read from the worker's own records (its memory), not FLEET_RUNNERS: a restarted
    # worker's dead predecessor's records, still in the bucket, are not among them.
    records = {"r1": record(RunnerLoading())}
    out = io.StringIO()
    news = asyncio.create_task(announce_own_runners(lambda: records.values(), out))
    try:
        records["r1"] = record(RunnerReady())
        await said(out, "fleet worker: runner r1 for m on node n is ready\n")
        records["r1"] = record(RunnerRunning())  # still ready: no second line
        records["r2"] = record(RunnerFailed(error="boom"), "r2")
        await said(out, "fleet worker: runner r1 for m on node n is ready\n"
                        "fleet worker: runner r2 for m on node n failed: boom\n")
    finally:
        news.cancel()
        await asyncio.gather(news, return_exceptions=True)


async def said(out: io.StringIO, text: str, timeout: float = 5.0) -> None:
    """Until the console holds exactly `text` (it is read every OWN_NEWS_PERIOD_S)."""
    deadline = time.monotonic() + timeout
    while out.getvalue() != text:
        assert time.monotonic() < deadline, out.getvalue()
        await asyncio.sleep(0.05)  # polling the console, bounded by the deadline


def test_status_text_shows_download_progress() -> None:
    downloading = RunnerDownloading(bytes_done=27 * MB, bytes_total=54 * MB)
    assert status_text(downloading) == "downloading [##########----------]  50% 27/54 MB"
    assert status_text(RunnerReady()) == "ready"
