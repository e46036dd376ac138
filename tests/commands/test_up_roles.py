"""`fleet up`'s roles in one task group (fleet/commands/stack.py): a worker or a gateway that
fails before it is ready fails `fleet up` with its own error, and a stop requested while they
start ends both. Real nats-server; the roles are stand-ins, so that each fails on cue."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

import fleet.commands.gateway
import fleet.commands.up_gateway
import fleet.worker.main
from fleet.commands.stack import StopRequested, run_up, stack
from fleet.config import Settings, load_settings
from fleet.errors import FleetError
from fleet.proc import Exit


@dataclass
class Cluster:
    node_id: str = "stand-in-node"


class StandInWorker:
    """`mode`: "fails" before it is ready, "ready" (then runs until stopped), "never" ready."""

    mode = "ready"
    runs: ClassVar[list[StandInWorker]] = []

    def __init__(self, settings: Settings) -> None:
        self.ready = asyncio.Event()
        self.cluster = Cluster()
        self.stopped = asyncio.Event()
        self.cancelled = False
        StandInWorker.runs.append(self)

    async def run(self) -> None:
        try:
            if self.mode == "fails":
                raise FleetError("the stand-in worker could not register")
            if self.mode == "ready":
                self.ready.set()
            await self.stopped.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def stop(self) -> None:
        self.stopped.set()


@pytest.fixture
def settings(tmp_path: Path, nats_url: str) -> Settings:
    return load_settings({"nats_url": nats_url, "data_dir": tmp_path / "data",
                          "gateway_port": 0}, env={})


@pytest.fixture(autouse=True)
def stand_in_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    StandInWorker.runs = []
    monkeypatch.setattr(fleet.worker.main, "Worker", StandInWorker)


async def test_a_worker_that_fails_before_ready_fails_fleet_up_with_its_error(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StandInWorker, "mode", "fails")
    with pytest.raises(FleetError, match="could not register"):
        async with asyncio.timeout(60), stack(settings, []):
            pytest.fail("fleet up served without its worker")


async def test_a_gateway_that_fails_before_ready_fails_fleet_up_and_stops_the_worker(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def serve(*args: Any, **kwargs: Any) -> None:
        raise FleetError("the stand-in gateway cannot listen")

    monkeypatch.setattr(fleet.commands.gateway, "serve", serve)
    with pytest.raises(FleetError, match="cannot listen"):
        async with asyncio.timeout(60), stack(settings, []):
            pytest.fail("fleet up served without its gateway")
    [worker] = StandInWorker.runs
    assert worker.stopped.is_set() and not worker.cancelled  # a clean stop, not a cancel


async def test_a_stop_while_the_worker_starts_ends_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StandInWorker, "mode", "never")
    exit_ = Exit()  # not installed: the test requests the stop itself
    exit_.stopping.set()
    with pytest.raises(StopRequested):
        async with asyncio.timeout(60), stack(settings, [], exit_):
            pytest.fail("fleet up served after a stop")
    [worker] = StandInWorker.runs
    assert worker.cancelled  # it never got as far as its loop: cancelled


async def test_a_gateway_process_that_exits_fails_fleet_up_with_its_status(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--processes split`: the gateway child's exit is `fleet up`'s failure, and its exit
    status is `fleet up`'s (a stand-in child that exits 3 at once)."""
    monkeypatch.setattr(fleet.commands.up_gateway, "gateway_command",
                        lambda fd: [sys.executable, "-c", "raise SystemExit(3)"])
    split = replace(settings, up_processes="split")
    async with asyncio.timeout(60):
        assert await run_up(split, [], Exit()) == 3
    [worker] = StandInWorker.runs
    assert worker.stopped.is_set() and not worker.cancelled  # a clean stop, not a cancel
