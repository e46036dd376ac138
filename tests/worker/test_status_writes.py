"""The runner status writer (fleet.worker.cluster): a runner's busy/idle flips are written at
most every FLIPS_EVERY_S, the newest one when due (issue 23: two KV puts and two events a task
at light load, each a send that gave the core away); everything else at once, in order. The
rule is pure (`written_at`, `same_state`); what readers of the bucket and the events see is
checked against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.aio import started
from fleet.bus.kv_calls import open_bucket
from fleet.config import Settings
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo, RunnerRecord, RunnerStatusChanged
from fleet.wire.codec import decode_model
from fleet.wire.runners import (
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShuttingDown,
    RunnerStatus,
    RunnerWarmingUp,
)
from fleet.worker.cluster import FLIPS_EVERY_S, ClusterLink, same_state, written_at
from fleet.worker.heartbeat import Heartbeat
from fleet.worker.state import RunnerView

READY, RUNNING = RunnerReady(), RunnerRunning(active_tasks=1)
EVERY = 0.05


@pytest.mark.parametrize(
    ("last", "status", "now", "at"),
    [
        # a flip after a flip written less than EVERY ago waits for it; the newest then
        ((READY, 10.0), RUNNING, 10.01, 10.05),
        ((RUNNING, 10.0), READY, 10.01, 10.05),
        ((RUNNING, 10.0), RunnerRunning(active_tasks=2), 10.049, 10.05),
        ((READY, 10.0), READY, 10.0, 10.05),
        # the first flip of a runner quiet for EVERY: at once
        ((READY, 10.0), RUNNING, 10.05, 10.05),
        ((RUNNING, 10.0), READY, 12.0, 12.0),
        # nothing written for it yet (a new runner, or since its removal): at once
        (None, RUNNING, 10.0, 10.0),
        (None, READY, 10.0, 10.0),
        # a removal: at once, whatever was written just before
        ((RUNNING, 10.0), None, 10.01, 10.01),
        (None, None, 10.0, 10.0),
        # a lifecycle step: at once, after a flip or before one
        ((RUNNING, 10.0), RunnerShuttingDown(), 10.01, 10.01),
        ((READY, 10.0), RunnerFailed(error="x"), 10.01, 10.01),
        ((RunnerLoading(layers_done=1), 10.0), RunnerLoading(layers_done=2), 10.01, 10.01),
        # the first busy/idle record after a lifecycle step (the Ready a waiter watches for
        # as its runner comes up): at once
        ((RunnerWarmingUp(), 10.0), READY, 10.01, 10.01),
        ((RunnerFailed(error="x"), 10.0), RUNNING, 10.01, 10.01),
    ],
)
def test_written_at(last: tuple[RunnerStatus, float] | None, status: RunnerStatus | None,
                    now: float, at: float) -> None:
    assert written_at(last, status, now, EVERY) == pytest.approx(at)


def record(status: RunnerStatus, active: int = 0, at: float = 1.0,
           runner_id: str = "r1") -> RunnerRecord:
    return RunnerRecord(runner_id=runner_id, instance_id="i1", node_id="n1", model="m",
                        status=status, active_tasks=active, at=at)


@pytest.mark.parametrize(
    ("newest", "last", "same"),
    [
        (record(READY, at=2.0), record(READY), True),  # flipped and back: only its time moved
        (record(RUNNING, 1, at=2.0), record(RUNNING, 1), True),
        (record(RUNNING, 1), record(READY), False),
        (record(RunnerRunning(active_tasks=2), 2), record(RUNNING, 1), False),
        (record(READY, 1), record(READY, 0), False),  # a count the record still holds
        (record(READY, runner_id="r2"), record(READY), False),
    ],
)
def test_same_state(newest: RunnerRecord, last: RunnerRecord, same: bool) -> None:
    assert same_state(newest, last) is same


# ---- what readers see (a real nats-server) --------------------------------------------------


def _info() -> NodeInfo:
    return NodeInfo(node_id="n1", hostname="h", memory_total_bytes=1, memory_available_bytes=1,
                    cpu_count=1, started_at=0.0, at=0.0)


class Seen:
    """The RunnerStatusChanged events of the link's node, as a subscriber reads them."""

    def __init__(self) -> None:
        self.events: list[RunnerStatusChanged] = []
        self.changed = asyncio.Condition()

    async def on_event(self, msg: Msg) -> None:
        async with self.changed:
            self.events.append(decode_model(RunnerStatusChanged, msg.data))
            self.changed.notify_all()

    async def until(self, count: int) -> list[str]:
        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(lambda: len(self.events) >= count)
        return self.states()

    def states(self) -> list[str]:
        return [_state(event.status) for event in self.events]


def _state(status: RunnerStatus) -> str:
    active = getattr(status, "active_tasks", None)
    return status.state if active is None else f"{status.state} {active}"


@pytest.fixture
async def link(provisioned_nc: Client, tmp_path: Path) -> AsyncIterator[tuple[ClusterLink, Seen]]:
    """A node's cluster link with only its status writer running, and what a subscriber to
    its runner events reads."""
    nc, js = provisioned_nc, provisioned_nc.jetstream()
    cluster = ClusterLink(Settings(data_dir=tmp_path), nc, js, asyncio.Queue())
    cluster.heartbeat = Heartbeat(nc, await open_bucket(js, subjects.NODES_BUCKET),
                                  await open_bucket(js, subjects.RUNNERS_BUCKET), "n1", _info,
                                  list)
    seen = Seen()
    await nc.subscribe(subjects.runner_event(cluster.node_id, "r1"), cb=seen.on_event)
    await nc.flush()
    writer = started(cluster._write_statuses_forever(), "status writer")
    try:
        yield cluster, seen
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer


VIEW = RunnerView(runner_id="r1", instance_id="i1", model="m", slots=4)


def _flip(cluster: ClusterLink, status: RunnerStatus, active: int) -> None:
    view = RunnerView(runner_id="r1", instance_id="i1", model="m", slots=4,
                      in_flight=frozenset(f"t{n}" for n in range(active)))
    cluster.runner_status(view, status)


async def _stored(nc: Client) -> RunnerRecord | None:
    kv = await open_bucket(nc.jetstream(), subjects.RUNNERS_BUCKET)
    with contextlib.suppress(Exception):
        entry = await kv.get("r1")
        return decode_model(RunnerRecord, entry.value) if entry.value else None
    return None


async def test_a_burst_of_flips_is_written_once_its_newest(
    link: tuple[ClusterLink, Seen], provisioned_nc: Client,
) -> None:
    """A runner that comes up, then flips 20 times at once (tasks starting and ending): the
    Ready it came up with is written at once, the flips as one record and one event, the
    newest (Running 2), no sooner than FLIPS_EVERY_S after that Ready; a lifecycle step after
    it at once."""
    cluster, seen = link
    cluster.runner_status(VIEW, RunnerWarmingUp())
    cluster.runner_status(VIEW, READY)
    assert await seen.until(2) == ["warming_up", "ready"]
    loop = asyncio.get_running_loop()
    # From when the Ready was queued, not when the test saw it: beside a CPU hog the test
    # read it more than FLIPS_EVERY_S later, and the flips, due by then, went at once.
    _, began = cluster._written[VIEW.runner_id]
    for n in range(10):
        _flip(cluster, RunnerRunning(active_tasks=1 + n % 2), 1 + n % 2)
        if n < 9:
            _flip(cluster, READY, 0)
    assert await seen.until(3) == ["warming_up", "ready", "running 2"]
    assert loop.time() - began >= FLIPS_EVERY_S * 0.9  # its timer's resolution
    stored = await _stored(provisioned_nc)
    assert stored is not None and (_state(stored.status), stored.active_tasks) == ("running 2", 2)
    _flip(cluster, RunnerShuttingDown(), 0)
    assert await seen.until(4) == ["warming_up", "ready", "running 2", "shutting_down"]


async def test_a_lifecycle_step_replaces_flips_not_yet_written(
    link: tuple[ClusterLink, Seen], provisioned_nc: Client,
) -> None:
    """Latest wins: flips held when the runner starts shutting down are never written, its
    ShuttingDown at once; its removal deletes the record, and nothing else follows."""
    cluster, seen = link
    cluster.runner_status(VIEW, READY)
    assert await seen.until(1) == ["ready"]
    _flip(cluster, RUNNING, 1)
    _flip(cluster, READY, 0)
    _flip(cluster, RUNNING, 1)
    _flip(cluster, RunnerShuttingDown(), 0)
    assert await seen.until(2) == ["ready", "shutting_down"]
    cluster.runner_removed("r1")
    async with asyncio.timeout(10):
        await cluster._status_writes.join()
    assert await _stored(provisioned_nc) is None
    await provisioned_nc.flush()  # any event published before the removal has come back
    assert cluster._held == {} and seen.states() == ["ready", "shutting_down"]


async def test_held_flips_are_written_when_the_link_stops(
    link: tuple[ClusterLink, Seen], provisioned_nc: Client,
) -> None:
    """The flips held when the worker stops are written before it goes (stop releases them
    and waits for the writer), so the bucket keeps the runner's last state."""
    cluster, seen = link
    cluster.runner_status(VIEW, READY)
    assert await seen.until(1) == ["ready"]
    _flip(cluster, RUNNING, 1)
    assert cluster._held
    cluster._release_all()
    async with asyncio.timeout(10):
        await cluster._status_writes.join()
    assert await seen.until(2) == ["ready", "running 1"]
    stored = await _stored(provisioned_nc)
    assert stored is not None and stored.active_tasks == 1
