"""Fixtures for the broker fault runs: the servers to hurt, and a run of two workers on them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.run import FaultRun, Load
from tests.faults.servers import Broker

# FLEET_FAULTS_LONG=1 runs the full sizes (docs/faults.md); unset, CI-sized ones.
LONG = os.environ.get("FLEET_FAULTS_LONG", "") not in ("", "0")


@pytest.fixture
def single_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker.single(tmp_path / "nats")
    yield broker
    broker.stop()


@pytest.fixture
def cluster_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker.cluster(tmp_path / "nats")
    yield broker
    broker.stop()


RunFactory = Callable[[Broker, Load, int], FaultRun]


@pytest.fixture
async def fault_run(tmp_path: Path) -> AsyncIterator[RunFactory]:
    """Make a FaultRun; its workers are killed and its client closed at teardown, before the
    broker fixture stops the servers."""
    runs: list[FaultRun] = []

    def make(broker: Broker, load: Load, replicas: int = 1) -> FaultRun:
        run = FaultRun(broker, tmp_path / "workers", load, replicas=replicas)
        runs.append(run)
        return run

    yield make
    for run in runs:
        await run.close()
