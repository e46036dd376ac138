"""Fixtures that start `fleet worker` processes against the per-test nats-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import WorkerProcess, seed_models

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
