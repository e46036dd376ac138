"""Fixtures that start `fleet worker` processes: one per test against the per-test
nats-server (`start_worker`), or one shared by a module's tests (`warm_tiny_llm`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleet.bus.embedded import EmbeddedNats
from fleet.models.catalog import get_card
from fleet.wire.cluster import ModelCard
from tests.integration.harness import WorkerProcess, client, place_and_wait, seed_models, wait_node

WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(
    nats_url: str, tmp_path: Path, tiny_llm_dir: Path
) -> Iterator[WorkerFactory]:
    started: list[WorkerProcess] = []

    def start(name: str = "w1", models: dict[str, Path] | None = None, **env: str) -> WorkerProcess:
        data_dir = tmp_path / name
        seed_models(data_dir, {"tiny-llm": tiny_llm_dir, **(models or {})})
        worker = WorkerProcess(nats_url, data_dir, **env).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


@dataclass(frozen=True)
class WarmStack:
    """A nats-server and one worker whose tiny-llm runner (4 slots) is ready."""

    nats_url: str
    worker: WorkerProcess
    node: str


@contextmanager
def warm_stack(
    root: Path, models: dict[str, Path], card: ModelCard, slots: int = 4, **env: str
) -> Iterator[WarmStack]:
    """A nats-server and one worker (`env` its settings) with `card` placed and its runner
    ready, for tests that share them: see warm_tiny_llm."""
    with EmbeddedNats(root / "nats", port=0, log_file=root / "nats.log") as server:
        seed_models(root / "w1", models)
        worker = WorkerProcess(server.url, root / "w1", **env).start()
        try:

            async def ready() -> str:
                nc = await client(server.url)
                try:
                    node = await wait_node(nc, worker.data_dir)
                    await place_and_wait(nc, card, node, slots=slots)
                    return node
                finally:
                    await nc.close()

            yield WarmStack(server.url, worker, asyncio.run(ready()))
        finally:
            worker.kill()


@pytest.fixture(scope="module")
def warm_tiny_llm(
    tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path
) -> Iterator[WarmStack]:
    """One stack for the module's tests that kill nothing, stop nothing and leave no task
    behind (each waits for its tasks' terminal events, under ids of its own): a worker and
    its runner start once (seconds of CPU each) instead of once per test."""
    root = tmp_path_factory.mktemp("warm")
    with warm_stack(root, {"tiny-llm": tiny_llm_dir}, get_card("tiny-llm")) as stack:
        yield stack
