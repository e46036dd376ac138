"""A standalone `fleet worker` says in its own console when its runner is ready, as `fleet up`
does (only another node's `fleet up` said so before)."""

from __future__ import annotations

from pathlib import Path

from fleet.models.catalog import get_card
from fleet.placement import place
from tests.commands.test_exits import Command, assert_clean
from tests.integration.harness import client, seed_models, wait_node


async def test_a_standalone_worker_says_when_its_runner_is_ready(
    nats_url: str, tmp_path: Path, tiny_llm_dir: Path
) -> None:
    seed_models(tmp_path / "data", {"tiny-llm": tiny_llm_dir})
    worker = Command(tmp_path, "worker", FLEET_NATS_URL=nats_url)
    nc = await client(nats_url)
    try:
        node = await wait_node(nc, tmp_path / "data")
        await place(nc.jetstream(), get_card("tiny-llm"), node_id=node)
        worker.wait_for_line("is ready", timeout=120)
        [line] = [line for line in worker.log().splitlines() if "is ready" in line]
        assert line.startswith("fleet worker: runner ") and f"on node {node}" in line, line
        assert "for tiny-llm" in line
        assert_clean(worker, *worker.terminate_and_time())
    finally:
        worker.kill()
        await nc.close()
